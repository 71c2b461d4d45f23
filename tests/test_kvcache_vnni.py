"""The int8 cache's (one scale per token and head) scores by AVX-512 VNNI
(sdpa_numba.cpu.int_dots): the query rows as two int16 digits of block floating point, exact
integer dot products. Against the float64 reference over the dequantized cache with the
float32 cache's tolerance (odd sizes, MHA and GQA with fewer than four rows a head, E 128 /
192 / 256, and 64 and 96 that take the float loop, contiguous and paged, split-KV), extreme
queries and keys, bitwise invariance to the thread count and to the rows sharing a task, the
digits themselves, and the selection at import following NUMBA_CPU_FEATURES.

One compiled specialization (float32 queries and scales, the int8 format) for all but the
subprocess test."""

import math
import os
import subprocess
import sys

import numba
import numpy as np
import pytest

from checks import TOL, rel_err
from kvcache_checks import (at_thread_counts, check_against_reference, paged_pair,
                            ref_sequence)
from sdpa_numba import attention_with_kvcache as kvattn
from sdpa_numba.cpu import int_dots
from sdpa_numba.cpu._llvm import data_ptr, has_vnni
from sdpa_numba.cpu.decode import CHUNK
from sdpa_numba.quant import dequantize_kv, quantize_kv

F32 = TOL[np.float32]


def _int8(rng, B, S, H, E):
    """Random int8 caches with one scale a row: (kq, ks, vq, vs, k64, v64)."""
    kq, ks = quantize_kv(rng.standard_normal((B, S, H, E)).astype(np.float32) * 2, "int8")
    vq, vs = quantize_kv(rng.standard_normal((B, S, H, E)).astype(np.float32), "int8")
    return (kq, ks, vq, vs, dequantize_kv(kq, ks, dtype=np.float64),
            dequantize_kv(vq, vs, dtype=np.float64))


def _paged(x, table, page_size):
    """``x`` (B, S, ...) in the pages of ``table`` (three unused pages of garbage)."""
    out = np.full((table.size + 3, page_size) + x.shape[2:], 77, x.dtype)
    for b in range(table.shape[0]):
        for p in range(table.shape[1]):
            rows = x[b, p * page_size:(p + 1) * page_size]
            out[table[b, p], :len(rows)] = rows
    return out


def _run(q, kq, vq, seqlens, ks, vs, **kw):
    out = np.full(q.shape, np.nan, np.float32)  # poisoned: every element must be written
    _, lse = kvattn(q, kq, vq, seqlens, k_scale=ks, v_scale=vs, return_lse=True, out=out,
                    **kw)
    return out, lse


def test_selected_on_this_cpu():
    # The selection is LLVM's answer for Numba's target; with VNNI switched off it is False.
    assert int_dots.HAS_VNNI == has_vnni()
    assert not has_vnni(features="-avx512vnni")
    assert not has_vnni(features="-avx512f")


@pytest.mark.parametrize("E", [64, 128, 192, 256, 96])
@pytest.mark.parametrize("page_size", [None, 48])
def test_against_reference(rng, E, page_size):
    # MHA (rows 1..3 a head: Lq 1..3) and GQA of two query heads a key/value head with Lq 1
    # (two rows); sequences cut in chunks (split-KV) and blocks (keys left to scalar loops);
    # E = 64 and 96 take the float loop.
    B, H, S = 2, 3, CHUNK + 77
    kq, ks, vq, vs, k64, v64 = _int8(rng, B, S, H, E)
    seqlens = np.array([CHUNK + 71, 45], np.int32)
    kc, vc, ksc, vsc, table = kq, vq, ks, vs, None
    if page_size is not None:  # shuffled pages, the scales paged with their values
        _, _, table = paged_pair(rng, ks, vs, page_size)
        kc, vc, ksc, vsc = (_paged(x, table, page_size) for x in (kq, vq, ks, vs))
    for hq, lq in ((H, 1), (H, 2), (H, 3), (2 * H, 1)):
        q = rng.standard_normal((B, lq, hq, E)).astype(np.float32)
        out, lse = _run(q, kc, vc, seqlens, ksc, vsc, block_table=table)
        check_against_reference(q, k64, v64, seqlens, out, lse, True, tol=F32)


def _extreme_queries(rng, B, Hq, E):
    q = rng.standard_normal((B, 1, Hq, E)).astype(np.float32)
    q[0, 0, 0] *= np.float32(1e30)  # huge, finite
    q[0, 0, 1] = 0  # a zero row: uniform weights
    mixed = rng.standard_normal(E) * np.where(np.arange(E) % 3 == 0, 1e-30, 1.0)
    q[0, 0, 2] = mixed.astype(np.float32)  # tiny and ordinary elements in one row
    q[1, 0, 0] = (rng.standard_normal(E) * 1e-38).astype(np.float32)  # subnormals among them
    big = rng.standard_normal(E) * np.where(np.arange(E) % 5 == 0, 3e4, 1e-6)
    q[1, 0, 1] = big.astype(np.float32)  # large and small, 10 binades apart
    q[1, 0, 2] = np.float32(-7.25)  # one value: the digits of every element alike
    return q


def test_extreme_queries_and_keys(rng):
    B, H, E, S = 2, 3, 128, 200
    kq, ks, vq, vs, _, _ = _int8(rng, B, S, H, E)
    kq[0, :40] = 0  # all-zero keys (scale kept): scores 0
    kq[0, 40:80] = -128  # the extremes of int8, beyond quantize_kv's +-127
    kq[0, 80:120] = 127
    kq[1, :64, 0, ::2] = -128
    kq[1, :64, 0, 1::2] = 127
    ks[1, 100:150] = 0  # keys of scale 0
    k64 = dequantize_kv(kq, ks, dtype=np.float64)
    v64 = dequantize_kv(vq, vs, dtype=np.float64)
    q = _extreme_queries(rng, B, H, E)
    seqlens = np.array([S, S - 13], np.int32)
    out, lse = _run(q, kq, vq, seqlens, ks, vs)
    assert np.isfinite(out).all()
    check_against_reference(q, k64, v64, seqlens, out, lse, True, tol=F32)


def test_bitwise_invariant_to_threads_and_rows(rng):
    # Split-KV (two chunks of the first sequence, one of the second) at 1 and 2 threads; a
    # sequence's rows the same whatever the batch position, the other sequences and the other
    # query heads.
    B, H, E, S = 3, 3, 128, CHUNK + 90
    kq, ks, vq, vs, _, _ = _int8(rng, B, S, H, E)
    q = rng.standard_normal((B, 1, H, E)).astype(np.float32)
    seqlens = np.array([CHUNK + 90, 333, 1], np.int32)
    one, two = at_thread_counts(lambda: _run(q, kq, vq, seqlens, ks, vs))
    for a, b in zip(one, two):
        np.testing.assert_array_equal(a, b)
    # sequence 0 moved to position 2, the others and head 1's query changed
    q2 = rng.standard_normal((B, 1, H, E)).astype(np.float32)
    q2[2] = q[0]
    q2[2, 0, 1] = rng.standard_normal(E).astype(np.float32)
    order = [1, 2, 0]
    out2, lse2 = _run(q2, kq[order], vq[order], seqlens[order], ks[order], vs[order])
    for h in (0, 2):
        np.testing.assert_array_equal(out2[2, :, h], one[0][0, :, h])
        np.testing.assert_array_equal(lse2[2, h], one[1][0, h])


@numba.njit
def _digits(q, n_rows, e_len, dig, fac):
    int_dots.prepare_rows(data_ptr(q), n_rows, e_len, dig, fac)


def test_digits_are_the_rows_in_block_floating_point(rng):
    E = 64
    rows = [rng.standard_normal(E), rng.standard_normal(E) * 1e30, np.zeros(E),
            rng.standard_normal(E) * np.where(np.arange(E) % 2, 1e-30, 1.0),
            rng.standard_normal(E) * 1e-40, np.full(E, -3.4e38),
            np.r_[np.ones(E - 1), np.nan], np.r_[np.ones(E - 1), -np.inf]]
    q = np.array(rows, np.float32)
    n = len(rows)
    dig = np.zeros(n * 2 * E, np.int16)
    fac = np.zeros(2 * n, np.float32)
    _digits(q.ravel(), n, E, dig, fac)
    d = dig.reshape(n, E // 32, 2, 32).astype(np.int64)
    big = (d[:, :, 1] * 65536 + d[:, :, 0]).reshape(n, E)  # Q_e
    for i in range(n - 2):
        x2 = float(fac[2 * i]) * float(fac[2 * i + 1])
        assert math.frexp(x2)[0] == 0.5  # a power of two
        qi = q[i].astype(np.float64)
        amax = np.abs(qi).max()
        assert np.abs(big[i]).max() <= int_dots.QMAX
        if amax == 0:
            assert (big[i] == 0).all()
            continue
        # the largest element keeps at least 31 significant bits: all of float32's
        assert np.abs(big[i]).max() >= 2 ** 30
        np.testing.assert_array_equal(big[i], np.rint(qi / x2))  # Q = rint(q 2^-x), exact
        assert np.abs(big[i] * x2 - qi).max() <= x2 / 2
    assert np.isnan(fac[-4:]).all() and (big[-2:] == 0).all()  # NaN or inf: scores NaN


def _selected_in_subprocess(env):
    """``int_dots.HAS_VNNI`` in a fresh process run with ``env`` (this checkout's package);
    nothing is compiled."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(int_dots.__file__))))
    code = "from sdpa_numba.cpu import int_dots; print(int_dots.HAS_VNNI)"
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, env=dict(env, PYTHONPATH=root))
    assert res.returncode == 0, res.stderr[-2000:]
    return res.stdout.split()[-1]


def test_selection_follows_numba_cpu_features(rng, tmp_path):
    # With avx512vnni switched off for Numba, the int8 scores take the float loop: not
    # selected, the results near the reference and (their last bits) not this process's.
    # On a CPU without VNNI, whose code could not run VNNI's instructions, the selection is
    # checked the other way round and only as a choice: Numba told to compile for a VNNI
    # CPU (znver4 with AVX-512 VNNI) selects it, told this CPU's features it does not.
    import llvmlite.binding as ll
    from numba.core import codegen

    features = codegen.get_host_cpu_features()
    if "+avx512vnni" not in features.split(","):
        assert not int_dots.HAS_VNNI
        base = {k: v for k, v in os.environ.items() if not k.startswith("NUMBA_CPU")}
        vnni = "+avx512f,+avx512bw,+avx512vl,+avx512vnni"
        assert _selected_in_subprocess(dict(base, NUMBA_CPU_NAME="znver4",
                                            NUMBA_CPU_FEATURES=vnni)) == "True"
        assert _selected_in_subprocess(dict(base, NUMBA_CPU_NAME=ll.get_host_cpu_name(),
                                            NUMBA_CPU_FEATURES=features)) == "False"
        return
    B, H, E, S = 1, 2, 128, 100
    kq, ks, vq, vs, k64, v64 = _int8(rng, B, S, H, E)
    q = rng.standard_normal((B, 1, H, E)).astype(np.float32)
    seqlens = np.array([S], np.int32)
    here, _ = _run(q, kq, vq, seqlens, ks, vs)
    np.savez(tmp_path / "case.npz", q=q, kq=kq, vq=vq, ks=ks, vs=vs, seqlens=seqlens)
    script = (
        "import sys, numpy as np\n"
        "from sdpa_numba.cpu import int_dots\n"
        "assert int_dots.__file__ == sys.argv[3], int_dots.__file__\n"
        "from sdpa_numba import attention_with_kvcache as f\n"
        "c = np.load(sys.argv[1])\n"
        "o = f(c['q'], c['kq'], c['vq'], c['seqlens'], k_scale=c['ks'], v_scale=c['vs'])\n"
        "np.save(sys.argv[2], o)\n"
        "print(int_dots.HAS_VNNI)\n")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(int_dots.__file__))))
    env = dict(os.environ, NUMBA_CPU_FEATURES=features.replace("+avx512vnni", "-avx512vnni"),
               NUMBA_NUM_THREADS="1", PYTHONPATH=root)  # this checkout's package
    res = subprocess.run([sys.executable, "-c", script, str(tmp_path / "case.npz"),
                          str(tmp_path / "out.npy"), int_dots.__file__], env=env,
                         capture_output=True, text=True, timeout=900)
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stdout.strip().splitlines()[-1] == "False"
    there = np.load(tmp_path / "out.npy")
    ro, _ = ref_sequence(q[0], k64[0], v64[0], True)
    assert rel_err(there[0], ro) < F32 and rel_err(here[0], ro) < F32
    assert not np.array_equal(here, there)  # another path: the last bits differ

