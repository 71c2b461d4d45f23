"""The bfloat16 forward's scores by ``vdpbf16ps`` (:mod:`sdpa_numba.cpu.pair_scores`).

* the choice: made from the CPU's features (LLVM's answer for a name and feature string), off
  when ``NUMBA_CPU_FEATURES`` switches AVX-512 BF16 off;
* the score tiles themselves against float64 (whole tiles, the 16-lane chunks of a partial
  sub-block, keys in place and copied), so that a silent fallback to the float32 path cannot
  pass them;
* the forward against the float64 reference with poisoned outputs on odd sizes (L and S not
  multiples of the 64 x 64 tiles, D 64 and 128, an odd D that takes the float32 path),
  causal, bool and additive masks, a soft cap, strided keys;
* subnormal queries and keys, which the instruction reads as zero, taking the float32 path.

The numerical tests need a CPU with AVX-512 BF16 and are skipped elsewhere (reported as
skipped, not passed).
"""

import os
import platform
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from numba import njit

from bf16_checks import BF16, check_forward, randn
from sdpa_numba import reference
from sdpa_numba import scaled_dot_product_attention as sdpa
from sdpa_numba.cpu import pair_scores
from sdpa_numba.cpu._llvm import data_ptr, has_pair_dot, keep_alive

ROOT = Path(__file__).resolve().parents[1]
X86 = platform.machine().lower() in ("x86_64", "amd64")
needs_pair_dot = pytest.mark.skipif(not pair_scores.PAIR_DOT,
                                    reason="the CPU Numba compiles for lacks AVX-512 BF16")


@pytest.mark.skipif(not X86, reason="LLVM x86 CPU names")
def test_choice_follows_the_features():
    assert has_pair_dot("skylake-avx512", "+avx512f,+avx512bf16,+avx512vl,+avx512bw")
    assert not has_pair_dot("znver4", "+avx512f,-avx512bf16")
    assert not has_pair_dot("x86-64-v3", "")  # no AVX-512 at all
    assert has_pair_dot("znver4", "")  # the name's defaults
    assert not has_pair_dot("znver3", "")
    assert pair_scores.PAIR_DOT == has_pair_dot()


@pytest.mark.skipif(not X86, reason="LLVM x86 CPU names")
def test_numba_cpu_features_switch_it_off():
    import llvmlite.binding as ll

    feats = ll.get_host_cpu_features()
    off = ",".join(("-" if k == "avx512bf16" or not on else "+") + k for k, on in feats.items())
    env = {k: v for k, v in os.environ.items() if not k.startswith("NUMBA_")}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")
    env["NUMBA_CPU_NAME"] = ll.get_host_cpu_name()
    env["NUMBA_CPU_FEATURES"] = off
    code = "from sdpa_numba.cpu import pair_scores; print(pair_scores.PAIR_DOT)"
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                          text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["False"]


@njit
def _tile(q, k, c, n_keys, lanes, st):
    """One score tile of the pair path: queries ``q`` (n x E), keys ``k`` (nj x E)."""
    n = q.shape[0]
    n_pad = (n + 63) // 64 * 64
    e_len = q.shape[1]
    qp = pair_scores.pair_buffer(q, n_pad * e_len)
    kp = pair_scores.pair_buffer(q, 64 * e_len)
    ok = pair_scores.pair_flags(q, n_pad // 64)
    f = pair_scores.pack_query_pairs(q, 0, n, n_pad, c, qp, ok)
    pair_scores.pack_key_pairs(k, 0, k.shape[0], kp)
    pair_scores.pair_scores(k, 0, k.shape[0], kp, qp, 0, data_ptr(st), n_keys, lanes)
    keep_alive((qp, kp))
    return f, pair_scores.all_flags(ok)


@needs_pair_dot
@pytest.mark.parametrize("n, nj, e_len, lanes, c", [
    (64, 64, 64, 64, 0.125),     # whole tiles, keys in place, a power-of-two scale
    (64, 64, 128, 64, 0.0884),   # E 128, a scale left partly to the tile (f = 1.41)
    (21, 37, 32, 32, 0.3),       # a partial block (keys copied), 2 chunks of 16 lanes
    (5, 64, 2, 16, 1.0),         # one pair, one chunk
])
def test_tiles_against_float64(rng, n, nj, e_len, lanes, c):
    q = randn(rng, (n, e_len)).view(np.int16)
    k = randn(rng, (nj, e_len)).view(np.int16)
    st = np.full(64 * 64, np.nan, np.float32)
    f, q_ok = _tile(q, k, c, nj, lanes, st)
    assert q_ok
    assert 1 <= f < 2 and f == c / 2.0 ** np.floor(np.log2(c))
    got = st.reshape(64, 64)[:nj, :min(n, lanes)].astype(np.float64) * f
    qf, kf = (np.asarray(x.view(BF16), np.float64) for x in (q, k))
    want = c * kf @ qf.T
    bound = 2e-6 * c * np.abs(kf) @ np.abs(qf).T + 1e-30  # float32 sums of e_len terms
    assert (np.abs(got - want[:, :min(n, lanes)]) <= bound[:, :min(n, lanes)]).all()
    # Lanes past the asked ones are left as they were (NaN); keys past nj are not asked for.
    if lanes < 64:
        assert np.isnan(st.reshape(64, 64)[:nj, lanes:]).all()


CASES = [
    # q shape, S, Ev, kwargs
    ((2, 3, 77, 64), 130, 64, {}),
    ((1, 2, 77, 128), 130, 128, {"is_causal": True}),
    ((1, 2, 65, 33), 200, 33, {"is_causal": True}),  # odd E: the float32 path
    ((1, 1, 1, 64), 70, 64, {}),  # one row: one 16-lane chunk
    ((1, 2, 130, 64), 77, 40, {"softcap": 2.0, "scale": 0.3}),
]


#: Masks on the first case, and a bool mask with causal (each mask kind is a compile).
PAIRS = ([(c, "none") for c in range(len(CASES))]
         + [(0, "bool"), (0, "additive"), (1, "bool")])


@needs_pair_dot
@pytest.mark.parametrize("case, mask", PAIRS)
def test_forward_against_reference(rng, case, mask):
    qs, s, ev, kw = CASES[case]
    q = randn(rng, qs)
    k = randn(rng, qs[:2] + (s, qs[3]))
    v = randn(rng, qs[:2] + (s, ev))
    m = None
    if mask == "bool":
        m = rng.random((qs[2], s)) < 0.7
        m[:, 0] = True
    elif mask == "additive":
        m = randn(rng, (1, qs[2], s))
    out = np.full(qs[:3] + (ev,), np.nan, BF16)
    res, lse = sdpa(q, k, v, m, out=out, return_lse=True, **kw)
    assert res is out
    check_forward(out, lse, q, k, v, m, **kw)


@needs_pair_dot
def test_strided_keys_are_copied(rng):
    q = randn(rng, (1, 2, 70, 64))
    k = randn(rng, (1, 2, 150, 128))[..., ::2]  # rows not contiguous: copied, not in place
    v = randn(rng, (1, 2, 150, 64))
    out = np.full(q.shape, np.nan, BF16)
    _, lse = sdpa(q, k, v, out=out, return_lse=True, is_causal=True)
    check_forward(out, lse, q, k, v, is_causal=True)


@needs_pair_dot
@pytest.mark.parametrize("which", ["query", "key", "scaled query"])
def test_subnormal_inputs_take_the_float32_path(rng, which):
    # Scores of order one from tiny and huge factors: with the subnormals read as zero
    # (vdpbf16ps) every score would be 0 and the softmax uniform.
    shape = (1, 2, 70, 16)
    q = rng.standard_normal(shape)
    k = rng.standard_normal(shape)
    scale = 1.0
    if which == "query":
        q, k = q * 8e-39, k * 6e37
    elif which == "key":
        q, k = q * 6e37, k * 8e-39
    else:  # normal, but subnormal times 2**-3, the power of two of the scale 0.2
        scale = 0.2
        q, k = np.sign(q) * 8e-38 * (1 + 0.1 * np.abs(q)), k * 5e37
    q, k = q.astype(BF16), k.astype(BF16)
    v = randn(rng, shape)
    out, lse = sdpa(q, k, v, scale=scale, return_lse=True)
    want, want_lse = reference.attention(q, k, v, scale=scale)
    assert np.std(want) > 0.1  # not the uniform softmax's mean of v
    np.testing.assert_allclose(np.asarray(out, np.float64), want, rtol=2 ** -7, atol=2 ** -7)
    np.testing.assert_allclose(lse, want_lse, rtol=1e-4, atol=1e-4)


@needs_pair_dot
@pytest.mark.parametrize("which", ["query", "key"])
def test_a_subnormal_changes_only_its_own_tiles(rng, which):
    # The float32 path is taken per tile (64 rows x 64 keys), not per task: rows 0..63 do not
    # see query row 100 nor (causal) key 100, so their bits do not change when that one holds
    # a subnormal, though they share a task with it (16 heads: tasks of all 150 rows).
    q, k, v = (randn(rng, (1, 16, 150, 64)) for _ in range(3))
    base, base_lse = sdpa(q, k, v, is_causal=True, return_lse=True)
    x = (q if which == "query" else k).copy()
    x[0, 0, 100, 5] = np.asarray(1e-39, BF16)
    args = (x, k, v) if which == "query" else (q, x, v)
    out, lse = sdpa(*args, is_causal=True, return_lse=True)
    # lse in float32 (the bfloat16 outputs' rounding could hide a difference)
    assert (lse[0, 0, :64] == base_lse[0, 0, :64]).all()
    assert (out[0, 0, :64].view(np.int16) == base[0, 0, :64].view(np.int16)).all()
    ref_out, _ = reference.attention(*args, is_causal=True)
    np.testing.assert_allclose(np.asarray(out, np.float64), ref_out, rtol=2 ** -7,
                               atol=2 ** -7)


@needs_pair_dot
def test_rows_do_not_depend_on_batch_or_threads(rng):
    # With a subnormal key in the third block, so that both paths run in one task.
    import numba

    q, k, v = (randn(rng, (3, 4, 157, 64)) for _ in range(3))
    k[1, 2, 140, 7] = np.asarray(-2e-39, BF16)
    threads = numba.get_num_threads()
    try:
        numba.set_num_threads(1)
        ref, ref_lse = sdpa(q[1:2], k[1:2], v[1:2], is_causal=True, return_lse=True)
        numba.set_num_threads(threads)
        out, lse = sdpa(q, k, v, is_causal=True, return_lse=True)
    finally:
        numba.set_num_threads(threads)
    assert (out[1:2].view(np.int16) == ref.view(np.int16)).all()
    assert (lse[1:2] == ref_lse).all()
    check_forward(out, lse, q, k, v, is_causal=True)


@needs_pair_dot
def test_varlen_against_reference(rng):
    # varlen reads each sequence's rows of (T, H, E) in place: keys with a row stride of H·E.
    from sdpa_numba import varlen_attention
    from varlen_checks import cu, reference_forward

    lq, lk = [70, 1, 130], [90, 64, 131]
    q = randn(rng, (sum(lq), 4, 64))
    k, v = randn(rng, (sum(lk), 2, 64)), randn(rng, (sum(lk), 2, 64))
    out, lse = varlen_attention(q, k, v, cu(lq), cu(lk), is_causal=True, return_lse=True)
    want, want_lse = reference_forward(q, k, v, cu(lq), cu(lk), is_causal=True)
    got = np.asarray(out, np.float64)
    assert np.abs(got - want).max() <= 2 ** -8 * np.abs(want).max() + 1e-5
    np.testing.assert_allclose(lse, want_lse, rtol=1e-5, atol=1e-5)
