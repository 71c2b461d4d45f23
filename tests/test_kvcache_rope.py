"""Rotary embedding on append (``rotary_cos``, ``rotary_sin``, ``rotary_interleaved``) and
``cache_batch_idx`` of attention_with_kvcache / kvcache_plan on the CPU.

The rotation is checked against a float64 rotation written here as complex multiplication
(independent of the library's), then attention_with_kvcache without rotation on copies of the
caches; cache_batch_idx against permuting the cache rows by hand. Bad input is refused with
the caches unwritten and the inputs unmodified."""

import numpy as np
import pytest

import sdpa_numba
from sdpa_numba import attention_with_kvcache as kvattn

try:
    from ml_dtypes import bfloat16
except ImportError:  # pragma: no cover
    bfloat16 = None


def tables(n, rd, dtype=np.float64, base=10000.0):
    """cos and sin tables (n, rd / 2) of positions 0 .. n - 1."""
    inv = base ** (-np.arange(rd // 2) / (rd // 2))
    ang = np.arange(n)[:, None] * inv[None, :]
    return np.cos(ang).astype(dtype), np.sin(ang).astype(dtype)


def rotate64(x, cos, sin, pos, interleaved):
    """x (B, L, H, E) rotated at positions pos (B, L), in float64, as complex numbers."""
    x = np.asarray(x, np.float64).copy()
    half = cos.shape[1]
    w = (cos.astype(np.float64)[pos] + 1j * sin.astype(np.float64)[pos])[:, :, None, :]
    if interleaved:
        z = (x[..., 0:2 * half:2] + 1j * x[..., 1:2 * half:2]) * w
        x[..., 0:2 * half:2], x[..., 1:2 * half:2] = z.real, z.imag
    else:
        z = (x[..., :half] + 1j * x[..., half:2 * half]) * w
        x[..., :half], x[..., half:2 * half] = z.real, z.imag
    return x


def problem(rng, B=3, Lq=1, Hq=6, H=2, E=9, Ev=5, S=24, new=1, N=None, dtype=np.float64):
    N = B if N is None else N
    f = lambda *s: rng.standard_normal(s).astype(dtype)  # noqa: E731
    return (f(B, Lq, Hq, E), f(N, S, H, E), f(N, S, H, Ev), f(B, new, H, E), f(B, new, H, Ev))


def positions(lens, n, per_token=True):
    return lens[:, None] + (np.arange(n)[None, :] if per_token else 0 * np.arange(n)[None, :])


CASES = [  # Lq, new, is_causal, window
    (1, 1, True, None),
    (3, 3, True, None),       # chunked prefill / speculative decoding
    (2, 2, False, None),      # not causal, not local: every q token at cache_seqlens
    (2, 2, False, (3, 1)),    # local: per-token positions
]


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("rd", [4, 8])  # < E, and = E - 1 for odd E = 9 (the last dim passes)
@pytest.mark.parametrize("Lq, new, is_causal, window", CASES)
def test_equals_numpy_rotation_then_append(rng, interleaved, rd, Lq, new, is_causal, window):
    q, kc, vc, k, v = problem(rng, Lq=Lq, new=new)
    lens = np.array([0, 5, 11])
    cos, sin = tables(16, rd)
    saved = [x.copy() for x in (q, k, v, cos, sin)]
    kw = dict(is_causal=is_causal, window=window, return_lse=True)
    k1, v1 = kc.copy(), vc.copy()
    out = np.full((3, Lq, 6, 5), np.nan)  # poisoned: every element must be written
    res, lse = kvattn(q, k1, v1, lens, k=k, v=v, rotary_cos=cos, rotary_sin=sin,
                      rotary_interleaved=interleaved, out=out, **kw)
    assert res is out
    per_token = is_causal or window is not None
    qr = rotate64(q, cos, sin, positions(lens, Lq, per_token), interleaved)
    kr = rotate64(k, cos, sin, positions(lens, new), interleaved)
    k2, v2 = kc.copy(), vc.copy()
    ref, ref_lse = kvattn(qr, k2, v2, lens, k=kr, v=v, **kw)
    # the rotated keys were appended (rounding differs only where a*c - b*s cancels)
    np.testing.assert_allclose(k1, k2, rtol=1e-15, atol=1e-15)
    np.testing.assert_array_equal(v1, v2)
    np.testing.assert_allclose(res, ref, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(lse, ref_lse, rtol=1e-12, atol=1e-12)
    for a, b in zip((q, k, v, cos, sin), saved):  # inputs unmodified
        np.testing.assert_array_equal(a, b)
    # the dims past rotary_dim passed through: the appended keys' last dim is k's
    for b, n in enumerate(lens):
        np.testing.assert_array_equal(k1[b, n:n + new, :, rd:], k[b, :, :, rd:])


def test_float32_gqa_leftpad_and_plan_runs(rng):
    """float32 tables and arrays; left padding does not shift positions; a plan's runs for
    two layers equal the one-shot calls, bit for bit."""
    q, kc, vc, k, v = problem(rng, Lq=2, new=2, Hq=8, H=2, E=12, dtype=np.float32)
    lens = np.array([3, 0, 17])
    pad = np.array([2, 0, 5])
    cos, sin = tables(20, 12, np.float32)
    kw = dict(cache_leftpad=pad, rotary_cos=cos, rotary_sin=sin)
    k1, v1 = kc.copy(), vc.copy()
    res = kvattn(q, k1, v1, lens, k=k, v=v, **kw)
    kr = rotate64(k, cos, sin, positions(lens, 2), False).astype(np.float32)
    qr = rotate64(q, cos, sin, positions(lens, 2), False).astype(np.float32)
    k2, v2 = kc.copy(), vc.copy()
    ref = kvattn(qr, k2, v2, lens, k=kr, v=v, cache_leftpad=pad)
    np.testing.assert_allclose(k1, k2, rtol=1e-7, atol=1e-7)  # within float32 rounding
    np.testing.assert_allclose(res, ref, rtol=1e-5, atol=1e-6)
    plan = sdpa_numba.kvcache_plan(q, kc, vc, lens, k=k, v=v, **kw)
    for layer in range(2):
        q_l, k_l = q * (layer + 1), k - layer
        kp, vp, ko, vo = kc.copy(), vc.copy(), kc.copy(), vc.copy()
        got = plan.run(q_l, kp, vp, k=k_l, v=v)
        want = kvattn(q_l, ko, vo, lens, k=k_l, v=v, **kw)
        np.testing.assert_array_equal(got, want)
        np.testing.assert_array_equal(kp, ko)


def test_paged_cache_and_plan_keeps_its_rows(rng):
    """A paged cache (shuffled pages of 3 slots) receives the rotated keys as a contiguous one
    does; a plan copied the table rows it uses (changing the tables afterwards changes
    nothing)."""
    B, H, E, ps, per = 2, 2, 6, 3, 4
    q, _, _, k, v = problem(rng, B=B, Lq=2, Hq=4, H=H, E=E, new=2)
    pk = rng.standard_normal((B * per, ps, H, E))
    pv = rng.standard_normal((B * per, ps, H, 5))
    table = rng.permutation(B * per).reshape(B, per).astype(np.int32)
    lens = np.array([2, 7])
    cos, sin = tables(12, 4)
    plan = sdpa_numba.kvcache_plan(q, pk, pv, lens, k=k, v=v, block_table=table,
                                   rotary_cos=cos, rotary_sin=sin, rotary_interleaved=True)
    cos[:], sin[:] = 0.0, 0.0
    a_k, a_v = pk.copy(), pv.copy()
    res = plan.run(q, a_k, a_v, k=k, v=v)
    cos, sin = tables(12, 4)
    qr = rotate64(q, cos, sin, positions(lens, 2), True)
    kr = rotate64(k, cos, sin, positions(lens, 2), True)
    b_k, b_v = pk.copy(), pv.copy()
    ref = kvattn(qr, b_k, b_v, lens, k=kr, v=v, block_table=table)
    np.testing.assert_allclose(a_k, b_k, rtol=1e-15, atol=1e-15)
    np.testing.assert_array_equal(a_v, b_v)
    np.testing.assert_allclose(res, ref, rtol=1e-12, atol=1e-12)


def test_cache_batch_idx_equals_permuted_rows(rng):
    """Sequence b reads and appends into cache row cache_batch_idx[b] of a cache with more
    rows than sequences; the other rows are untouched. With rotation too."""
    q, kc, vc, k, v = problem(rng, Lq=2, new=2, N=5)
    lens = np.array([4, 0, 9])
    idx = np.array([4, 0, 2], np.int32)
    cos, sin = tables(12, 6)
    k1, v1 = kc.copy(), vc.copy()
    res, lse = kvattn(q, k1, v1, lens, k=k, v=v, cache_batch_idx=idx, rotary_cos=cos,
                      rotary_sin=sin, return_lse=True)
    kp, vp = kc[idx].copy(), vc[idx].copy()  # the rows by hand
    ref, ref_lse = kvattn(q, kp, vp, lens, k=k, v=v, rotary_cos=cos, rotary_sin=sin,
                          return_lse=True)
    np.testing.assert_array_equal(res, ref)
    np.testing.assert_array_equal(lse, ref_lse)
    want_k, want_v = kc.copy(), vc.copy()
    want_k[idx], want_v[idx] = kp, vp
    np.testing.assert_array_equal(k1, want_k)
    np.testing.assert_array_equal(v1, want_v)
    # Without an append rows may repeat (int64 indices), read-only.
    idx2 = np.array([1, 1, 3], np.int64)
    got = kvattn(q, kc, vc, lens, cache_batch_idx=idx2)
    want = kvattn(q, kc[idx2], vc[idx2], lens)
    np.testing.assert_array_equal(got, want)


def test_rotation_into_int8_cache(rng):
    """An int8 cache receives the rotated keys, quantized: the same as quantizing keys rotated
    beforehand."""
    q, kc, vc, k, v = problem(rng, new=1, E=8, Ev=8)
    lens = np.array([2, 6, 0])
    cos, sin = tables(8, 8)
    kq, ks = sdpa_numba.quant.quantize_kv(kc, "int8")
    vq, vs = sdpa_numba.quant.quantize_kv(vc, "int8")
    a = [x.copy() for x in (kq, vq, ks, vs)]
    res = kvattn(q, a[0], a[1], lens, k=k, v=v, k_scale=a[2], v_scale=a[3], rotary_cos=cos,
                 rotary_sin=sin)
    b = [x.copy() for x in (kq, vq, ks, vs)]
    kr = rotate64(k, cos, sin, positions(lens, 1), False)
    qr = rotate64(q, cos, sin, positions(lens, 1), False)
    ref = kvattn(qr, b[0], b[1], lens, k=kr, v=v, k_scale=b[2], v_scale=b[3])
    for x, y in zip(a, b):  # (int8 rounding of keys equal to 1e-15: rarely one step apart)
        np.testing.assert_allclose(x.astype(np.float64), y.astype(np.float64), atol=1)
    np.testing.assert_array_equal(a[1], b[1])
    np.testing.assert_allclose(res, ref, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
@pytest.mark.parametrize("interleaved", [False, True])
def test_rotation_kernel_half_dtypes(rng, dtype, interleaved):
    """The CPU rotation pass alone on float16 / bfloat16 / float32 storage: within one unit in
    the last place of the float64 rotation rounded (half types round by way of float32)."""
    from sdpa_numba.cpu.rope import rotate

    if dtype == "bfloat16" and bfloat16 is None:
        pytest.skip("ml_dtypes missing")
    dt = bfloat16 if dtype == "bfloat16" else np.dtype(dtype)
    x = rng.standard_normal((2, 3, 4, 11)).astype(dt)
    x_saved = x.copy()
    cos, sin = tables(9, 6)
    pos = np.array([[0, 4, 8], [1, 2, 3]])
    got = rotate(x, np.ascontiguousarray(cos[pos]), np.ascontiguousarray(sin[pos]),
                 interleaved)
    want = rotate64(x.astype(np.float64), cos, sin, pos, interleaved).astype(dt)
    assert got.dtype == x.dtype and got.shape == x.shape
    np.testing.assert_array_equal(x, x_saved)
    g, w = got.astype(np.float64), want.astype(np.float64)
    ulp = np.spacing(np.abs(w).astype(np.float32 if dtype == "float32" else np.float16)
                     ).astype(np.float64)
    if dtype == "bfloat16":
        ulp = np.abs(w) * 2.0 ** -7 + 1e-30
    assert np.all(np.abs(g - w) <= ulp), np.abs(g - w).max()
    np.testing.assert_array_equal(got[..., 6:], x[..., 6:])


def _refusal_cases(q, kc, vc, k, v, lens, cos, sin):
    ok = dict(k=k, v=v, rotary_cos=cos, rotary_sin=sin)
    return [
        (ValueError, "block_table", dict(k=k, v=v, block_table=np.zeros((3, 1), np.int32),
                                         cache_batch_idx=np.arange(3))),
        (ValueError, "cache_batch_idx", dict(k=k, v=v, cache_batch_idx=np.arange(2))),
        (TypeError, "cache_batch_idx", dict(k=k, v=v, cache_batch_idx=np.arange(3.0))),
        (ValueError, "cache_batch_idx", dict(k=k, v=v, cache_batch_idx=np.array([0, 1, 3]))),
        (ValueError, "cache_batch_idx", dict(k=k, v=v, cache_batch_idx=np.array([0, -1, 2]))),
        (ValueError, "cache_batch_idx", dict(k=k, v=v, cache_batch_idx=np.array([2, 0, 2]))),
        (ValueError, "pass k and v", dict(rotary_cos=cos, rotary_sin=sin)),
        (ValueError, "together", dict(k=k, v=v, rotary_cos=cos)),
        (ValueError, "rotary_sin", {**ok, "rotary_sin": sin[:, :2]}),
        (ValueError, "rotary_cos", {**ok, "rotary_cos": cos[:3], "rotary_sin": sin[:3]}),
        (ValueError, "rotary_cos", {**ok, "rotary_cos": tables(16, 10)[0],
                                    "rotary_sin": tables(16, 10)[1]}),
        (ValueError, "rotary_cos", {**ok, "rotary_cos": cos[None], "rotary_sin": sin[None]}),
        (TypeError, "rotary_cos", {**ok, "rotary_cos": cos.astype(np.int32)}),
        (TypeError, "rotary_interleaved", {**ok, "rotary_interleaved": 1}),
    ]


def test_bad_input_refused_nothing_written(rng):
    q, kc, vc, k, v = problem(rng, new=1)
    lens = np.array([1, 2, 3])
    cos, sin = tables(16, 6)
    before = [x.copy() for x in (q, kc, vc, k, v, cos, sin)]
    for err, what, kw in _refusal_cases(q, kc, vc, k, v, lens, cos, sin):
        with pytest.raises(err, match=what):
            kvattn(q, kc, vc, lens, **kw)
        with pytest.raises(err, match=what):
            sdpa_numba.kvcache_plan(q, kc, vc, lens, **kw)
        for x, y in zip((q, kc, vc, k, v, cos, sin), before):
            assert x.tobytes() == y.tobytes(), what
