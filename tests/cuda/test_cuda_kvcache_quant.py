"""Quantized KV caches (int8 per token and head, q8_0, fp8 e4m3fn / e5m2) on CUDA arrays,
under the simulator: the CUDA decode kernel and append against the CPU path on the same
inputs (the appended bytes and scales bit for bit, the results within float32 rounding) and
against the float64 reference over the dequantized cache; the refusals with nothing written;
and the real kernels lowered for the device (the simulator does not type them)."""

import ml_dtypes
import numpy as np
import pytest
from numba import cuda

from checks import TOL
from kvcache_checks import VARIANTS, check_against_reference
from sdpa_cuda_testing import dev, rel_err, small_decode_blocks
from sdpa_numba import attention_with_kvcache as kvattn
from sdpa_numba.gpu.quant import value_table
from sdpa_numba.quant import dequantize_kv, quantize_kv

F32 = TOL[np.float32]


@pytest.fixture(autouse=True)
def _small_blocks(monkeypatch):
    small_decode_blocks(monkeypatch)


def _quantized(rng, fmt, B, S, H, E, Ev, scale_dtype=np.float32, per_head=True):
    kc = rng.standard_normal((B, S, H, E)).astype(np.float32) * 2
    vc = rng.standard_normal((B, S, H, Ev)).astype(np.float32)
    kq, ks = quantize_kv(kc, fmt, scale_dtype=scale_dtype, per_head=per_head)
    vq, vs = quantize_kv(vc, fmt, scale_dtype=scale_dtype, per_head=per_head)
    return kq, ks, vq, vs


def _paged(x, table, n_pages, ps, fill):
    """Contiguous ``x`` (B, S, ...) as pages of ``ps`` rows at ``table``'s pages; the other
    slots ``fill`` (the bytes of a quantized cache, finite scales: they are all checked)."""
    out = np.full((n_pages, ps, *x.shape[2:]), fill, x.dtype)
    for b in range(x.shape[0]):
        for p in range(table.shape[1]):
            rows = x[b, p * ps:(p + 1) * ps]
            out[table[b, p], :len(rows)] = rows
    return out


def _bytes(*xs):
    return [np.asarray(x).tobytes() for x in xs]


def _run_both(q, kq, vq, ks, vs, seqlens, kn=None, vn=None, **kw):
    """The call on device copies and on host copies: ``(gpu, cpu)``, each ``(out, lse, kq,
    vq, ks, vs)`` (the caches and scales after the call, on the host)."""
    d = [dev(x) if isinstance(x, np.ndarray) and x.ndim else x for x in (kq, vq, ks, vs)]
    out = cuda.to_device(np.full(q.shape[:-1] + vq.shape[3:], np.nan, q.dtype))
    res, lse = kvattn(dev(q), d[0], d[1], seqlens, k=dev(kn), v=dev(vn), k_scale=d[2],
                      v_scale=d[3], out=out, return_lse=True,
                      **{n: dev(x) if n == "block_table" else x for n, x in kw.items()})
    assert res is out
    host = [np.array(x, copy=True) for x in (kq, vq, ks, vs)]
    ref, ref_lse = kvattn(q, host[0], host[1], seqlens, k=kn, v=vn, k_scale=host[2],
                          v_scale=host[3], return_lse=True, **kw)
    gpu = [res.copy_to_host(), lse.copy_to_host()] + [
        x.copy_to_host() if hasattr(x, "copy_to_host") else x for x in d]
    return gpu, [ref, ref_lse, *host]


def _same_as_cpu(gpu, cpu, tol=1e-5):
    for a, b in zip(gpu[2:], cpu[2:]):  # the caches and scales: bit for bit
        assert np.asarray(a).tobytes() == np.asarray(b).tobytes()
    assert rel_err(gpu[0], cpu[0]) < tol
    finite = np.isfinite(cpu[1])
    np.testing.assert_array_equal(gpu[1][~finite], cpu[1][~finite])
    np.testing.assert_allclose(gpu[1][finite], cpu[1][finite], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("fmt,dtype", [("int8", np.float32), ("q8_0", np.float32),
                                       ("e4m3fn", np.float32), ("e5m2", np.float16)])
def test_contiguous_formats_gqa_zero_length_and_chunks(rng, fmt, dtype):
    # Sequences: none, one key, several chunks (CHUNK 8); GQA; Lq = 2; fp8 descales per
    # (B, H); e5m2 with float16 queries.
    B, Lq, Hq, H, S = 3, 2, 4, 2, 14
    E, Ev = (32, 32) if fmt == "q8_0" else (5, 3)
    kq, ks, vq, vs = _quantized(rng, fmt, B, S, H, E, Ev)
    q = rng.standard_normal((B, Lq, Hq, E)).astype(dtype)
    seqlens = np.array([0, 1, 13])
    gpu, cpu = _run_both(q, kq, vq, ks, vs, seqlens)
    _same_as_cpu(gpu, cpu, 1e-3 if dtype == np.float16 else 1e-5)
    assert _bytes(*gpu[2:]) == _bytes(kq, vq, ks, vs)  # no append: nothing written
    check_against_reference(q, dequantize_kv(kq, ks, dtype=np.float64),
                            dequantize_kv(vq, vs, dtype=np.float64), seqlens, gpu[0], gpu[1],
                            True, tol=None if dtype == np.float16 else F32)


@pytest.mark.parametrize("fmt,ps,scale_dtype", [("int8", 1, np.float32),
                                                ("q8_0", 3, np.float16),
                                                ("e4m3fn", 3, np.float32),
                                                ("e5m2", 1, np.float32)])
def test_paged_append_across_pages_as_the_cpu(rng, fmt, ps, scale_dtype):
    # Appends start mid-page and cross into the next page; the appended bytes and scales are
    # the CPU append's bit for bit (fp8: one descale for the tensor, values saturating).
    B, Hq, H, new = 2, 2, 1, 3
    E, Ev = (32, 64) if fmt == "q8_0" else (6, 5)
    S = 4 * ps + 4
    kq, ks, vq, vs = _quantized(rng, fmt, B, S, H, E, Ev, scale_dtype, per_head=False)
    per = -(-S // ps)
    n_pages = B * per + 2
    table = rng.permutation(n_pages)[:B * per].reshape(B, per).astype(np.int32)
    garbage = np.uint8(0x55)
    pk = _paged(kq.view(np.uint8), table, n_pages, ps, garbage).view(kq.dtype)
    pv = _paged(vq.view(np.uint8), table, n_pages, ps, garbage).view(vq.dtype)
    if fmt in ("int8", "q8_0"):
        ks = _paged(ks, table, n_pages, ps, 7.0)
        vs = _paged(vs, table, n_pages, ps, 7.0)
    seqlens = np.array([2 * ps - 1, ps + 1])
    q = rng.standard_normal((B, 2, Hq, E)).astype(np.float32)
    kn = rng.standard_normal((B, new, H, E)).astype(np.float32) * 3  # fp8: some saturate
    vn = rng.standard_normal((B, new, H, Ev)).astype(np.float32)
    kn[0, 1, 0] = 0  # a zero row: scale 0, values 0
    gpu, cpu = _run_both(q, pk, pv, ks, vs, seqlens, kn, vn, block_table=table)
    _same_as_cpu(gpu, cpu)
    assert _bytes(*gpu[2:4]) != _bytes(pk, pv)  # it did append
    check_against_reference(q, dequantize_kv(cpu[2], cpu[4], dtype=np.float64),
                            dequantize_kv(cpu[3], cpu[5], dtype=np.float64), seqlens + new,
                            gpu[0], gpu[1], True, table=table, tol=F32)


@pytest.mark.parametrize("variant", ["softcap", "alibi_sinks"])
def test_variants_and_left_padding_with_int8_cache(rng, variant):
    B, Lq, Hq, H, E, Ev, S = 2, 2, 4, 2, 7, 4, 12
    kq, ks, vq, vs = _quantized(rng, "int8", B, S, H, E, Ev)
    q = rng.standard_normal((B, Lq, Hq, E)).astype(np.float32)
    seqlens = np.array([5, 11])
    kw = VARIANTS[variant](rng, B, Hq)
    leftpad = np.array([1, 3])  # left padding too
    gpu, cpu = _run_both(q, kq, vq, ks, vs, seqlens, cache_leftpad=leftpad, **kw)
    _same_as_cpu(gpu, cpu)
    causal = kw.pop("is_causal", True)
    check_against_reference(q, dequantize_kv(kq, ks, dtype=np.float64),
                            dequantize_kv(vq, vs, dtype=np.float64), seqlens, gpu[0], gpu[1],
                            causal, tol=F32, leftpad=leftpad, **kw)


@pytest.mark.parametrize("variant,fmt", [("window", "e4m3fn"), ("window_not_causal", "e5m2"),
                                         ("chunk", "q8_0"), ("mods", "int8")])
def test_window_chunk_and_mask_mod_with_quantized_cache(rng, variant, fmt):
    # The masks that cut a block (a sliding window, chunked attention, a user's mask_mod with
    # a score_mod) over a quantized cache: as the CPU's call on the same cache, and within
    # float32 rounding of the float64 reference over the dequantized cache. Sequences long
    # enough for several of the small blocks and chunks, one with a single key; GQA, Lq = 2.
    B, Lq, Hq, H, S = 3, 2, 4, 2, 14
    E, Ev = (32, 32) if fmt == "q8_0" else (7, 5)
    kq, ks, vq, vs = _quantized(rng, fmt, B, S, H, E, Ev)
    q = rng.standard_normal((B, Lq, Hq, E)).astype(np.float32)
    seqlens = np.array([13, 1, 9])
    kw = VARIANTS[variant](rng, B, Hq)
    gpu, cpu = _run_both(q, kq, vq, ks, vs, seqlens, **kw)
    _same_as_cpu(gpu, cpu)
    causal = kw.pop("is_causal", True)
    check_against_reference(q, dequantize_kv(kq, ks, dtype=np.float64),
                            dequantize_kv(vq, vs, dtype=np.float64), seqlens, gpu[0], gpu[1],
                            causal, tol=F32, **kw)


def test_ragged_batch_appends_as_the_cpu(rng):
    # cu_seqlens_q: each sequence's new keys are its query rows (one with none).
    Hq, H, E, S = 2, 1, 32, 10
    kq, ks, vq, vs = _quantized(rng, "q8_0", 3, S, H, E, E)
    cu = np.array([0, 2, 2, 5])
    q = rng.standard_normal((5, Hq, E)).astype(np.float32)
    kn = rng.standard_normal((5, H, E)).astype(np.float32)
    vn = rng.standard_normal((5, H, E)).astype(np.float32)
    gpu, cpu = _run_both(q, kq, vq, ks, vs, np.array([3, 0, 4]), kn, vn, cu_seqlens_q=cu)
    _same_as_cpu(gpu, cpu)


def test_plan_runs_each_layer_bfloat16_as_the_cpu(rng):
    # kvcache_plan: made once, run for two layers' caches and scales (bfloat16 queries and
    # new rows, an append), each as the CPU's call for that layer.
    from sdpa_numba import kvcache_plan
    from sdpa_numba._bf16 import bfloat16

    bf = bfloat16()
    B, Hq, H, E, S = 2, 2, 1, 32, 9
    seqlens = np.array([4, 7])
    layers = [_quantized(rng, "q8_0", B, S, H, E, E) for _ in range(2)]
    qs = [rng.standard_normal((B, 1, Hq, E)).astype(bf) for _ in range(2)]
    kns = [rng.standard_normal((B, 1, H, E)).astype(bf) for _ in range(2)]
    vns = [rng.standard_normal((B, 1, H, E)).astype(bf) for _ in range(2)]
    d = [[dev(x) for x in (kq, vq, ks, vs)] for kq, ks, vq, vs in layers]
    plan = kvcache_plan(dev(qs[0]), d[0][0], d[0][1], seqlens, k=dev(kns[0]), v=dev(vns[0]),
                        k_scale=d[0][2], v_scale=d[0][3])
    for i, (kq, ks, vq, vs) in enumerate(layers):
        res = plan.run(dev(qs[i]), d[i][0], d[i][1], k=dev(kns[i]), v=dev(vns[i]),
                       k_scale=d[i][2], v_scale=d[i][3])
        host = [np.array(x, copy=True) for x in (kq, vq, ks, vs)]
        ref = kvattn(qs[i], host[0], host[1], seqlens, k=kns[i], v=vns[i], k_scale=host[2],
                     v_scale=host[3])
        assert _bytes(*(x.copy_to_host() for x in d[i])) == _bytes(*host)
        assert rel_err(res.copy_to_host().astype(np.float32), ref.astype(np.float32)) < 1e-2
        np.testing.assert_allclose(res.copy_to_host().astype(np.float32),
                                   ref.astype(np.float32), rtol=0, atol=2e-2)


def _crafted_row(fmt):
    """Values whose quantization is decided by the rounding rule: every midpoint between two
    neighbouring values of the format (ties), the values themselves, both signs, values past
    the largest (saturation), tiny ones and -0.0, at a scale (descale) of exactly 1."""
    if fmt == "int8":  # absmax 127: scale 1 (in float16 too)
        return np.r_[np.arange(-126.5, 127.0), 127.0, -127.0]
    t = value_table()[1 if fmt == "e4m3fn" else 2].astype(np.float64)
    pos = t[:0x7F if fmt == "e4m3fn" else 0x7C]
    mids = (pos[:-1] + pos[1:]) / 2
    x = np.r_[mids, pos, pos[-1] * 1.5, 1e30, 1e-30, 0.0]
    x = np.r_[x, -x]
    return np.r_[x, np.zeros(-len(x) % 8)]


@pytest.mark.parametrize("fmt,scale_dtype", [("int8", np.float16), ("e4m3fn", np.float32),
                                             ("e5m2", np.float32)])
def test_append_rounds_ties_to_even_and_saturates_as_the_cpu(rng, fmt, scale_dtype):
    row = _crafted_row(fmt)
    E = len(row)
    kq, ks, vq, vs = _quantized(rng, fmt, 1, 3, 1, E, 8, scale_dtype, per_head=False)
    if fmt != "int8":  # descale 1 for the keys, 0 for the values (all values become 0)
        ks, vs = np.float32(1.0), np.float32(0.0)
    kn = row.astype(np.float32)[None, None, None]
    vn = rng.standard_normal((1, 1, 1, 8)).astype(np.float32)
    q = rng.standard_normal((1, 1, 1, E)).astype(np.float32) * 0.01
    gpu, cpu = _run_both(q, kq, vq, np.asarray(ks), np.asarray(vs), np.array([1]), kn, vn)
    _same_as_cpu(gpu, cpu)
    got = gpu[2][0, 1, 0].view(np.uint8)
    if fmt == "int8":
        np.testing.assert_array_equal(got.view(np.int8), np.rint(row))
    else:
        top = float(np.finfo(kq.dtype).max)  # ml_dtypes rounds to nearest even, unsaturated
        np.testing.assert_array_equal(got, np.clip(kn[0, 0, 0], -top, top).astype(kq.dtype)
                                      .view(np.uint8))
        assert not gpu[3][0, 1].view(np.uint8).any()


def _device_operands(rng, fmt="int8", E=8):
    kq, ks, vq, vs = _quantized(rng, fmt, 1, 6, 1, E, E)
    return [dev(x) for x in (kq, vq, ks, vs)]


@pytest.mark.parametrize("case", ["k_scale shape", "scale dtype", "q8_0 E", "NaN scale",
                                  "inf in k", "host scale", "fp8 descale shape", "no scales"])
def test_bad_input_refused_with_nothing_written(rng, case):
    E = 8
    kq, vq, ks, vs = _device_operands(rng, "e5m2" if case == "fp8 descale shape" else "int8")
    q = dev(rng.standard_normal((1, 1, 2, E)).astype(np.float32))
    kn = rng.standard_normal((1, 1, 1, E)).astype(np.float32)
    vn = rng.standard_normal((1, 1, 1, E)).astype(np.float32)
    kw = {"k_scale": ks, "v_scale": vs}
    err = ValueError
    if case == "k_scale shape":
        kw["k_scale"] = dev(np.ones((1, 5, 1), np.float32))
    elif case == "scale dtype":
        kw = {"k_scale": dev(np.ones((1, 6, 1))), "v_scale": dev(np.ones((1, 6, 1)))}
        err = TypeError
    elif case == "q8_0 E":  # E = 8: one q8_0 block would be 32 values
        kw = {"k_scale": dev(np.ones((1, 6, 1, 1), np.float32)),
              "v_scale": dev(np.ones((1, 6, 1, 1), np.float32))}
    elif case == "NaN scale":
        bad = vs.copy_to_host()
        bad[0, 2, 0] = np.nan
        kw["v_scale"] = dev(bad)
    elif case == "inf in k":
        kn[0, 0, 0, 3] = np.inf
    elif case == "host scale":
        kw["k_scale"] = ks.copy_to_host()
        err = TypeError
    elif case == "fp8 descale shape":
        kw = {"k_scale": dev(np.ones((2, 1), np.float32)), "v_scale": vs}
    elif case == "no scales":
        kw = {}
    before = _bytes(*(x.copy_to_host() for x in (kq, vq, ks, vs)))
    with pytest.raises(err, match="k_scale|v_scale|finite|multiple of 32|scale"):
        kvattn(q, kq, vq, np.array([2]), k=dev(kn), v=dev(vn), **kw)
    assert _bytes(*(x.copy_to_host() for x in (kq, vq, ks, vs))) == before


def test_value_table_is_the_formats():
    t = value_table()
    u = np.arange(256, dtype=np.uint8)
    np.testing.assert_array_equal(t[0], u.view(np.int8).astype(np.float32))
    for row, fp8 in ((1, ml_dtypes.float8_e4m3fn), (2, ml_dtypes.float8_e5m2)):
        np.testing.assert_array_equal(t[row], u.view(fp8).astype(np.float32))


LOWERING = """
    import numba
    import numpy as np
    from numba.cuda import compiler as cuda_compiler
    import sdpa_numba.gpu.decode as gd
    import sdpa_numba.gpu.quant as gq
    from sdpa_numba.gpu.variants import compile_key, arg_type
    from sdpa_numba.score.recipe import DENSE

    def A(dt, nd):
        return types.Array(numba.from_dtype(np.dtype(dt)), nd, "A")

    def chunk_sig(ct, cache, qz, parts):
        return types.void(A(np.float32, 4), A(cache, 4), A(cache, 4), A(np.int32, 2),
                          A(np.int64, 1), A(np.int64, 1), A(np.int64, 1), A(np.int64, 1),
                          A(np.int64, 1), types.int64, types.float64, A(ct, 3), A(ct, 2),
                          arg_type(parts), A(np.int64, 2), types.int64, qz)

    for ct, sdt, r in ((np.float32, np.float32, DENSE),
                       (np.float32, np.float16, DENSE._replace(softcap=2.0)),
                       (np.float64, np.float32, DENSE._replace(alibi=np.ones((1, 4))))):
        parts = compile_key(r)
        qz = types.Tuple((A(sdt, 4), A(sdt, 4), A(np.float32, 2), A(np.float32, 2),
                          types.int64, A(np.float32, 2)))
        ir = lowered_ir(lambda: gd._make_kernels(numba.from_dtype(np.dtype(ct)), 8, 32, parts,
                                                 True)[0], chunk_sig(ct, np.uint8, qz, parts))
        print("quant", np.dtype(ct).name, np.dtype(sdt).name, "fmul" in ir)
    # The float kernel: its quantized branches pruned (qz, an empty tuple, is never read).
    parts = compile_key(DENSE)
    ir = lowered_ir(lambda: gd._make_kernels(numba.float32, 8, 32, parts, False)[0],
                    chunk_sig(np.float32, np.float32, types.Tuple(()), parts))
    print("float", "fmul" in ir)
    for xdt, sdt in ((np.float32, np.float32), (np.float16, np.float16),
                     (np.int16, np.float32), (np.float64, np.float16)):
        sig = (A(xdt, 4), A(np.int8, 4), A(np.uint8, 4), A(sdt, 4), A(np.float32, 2),
               A(np.int64, 1), A(np.int64, 1), A(np.int64, 1), types.int64, types.boolean,
               A(np.float32, 2))
        cres = cuda_compiler.compile_cuda(gq._append_kernel.py_func, types.void, sig,
                                          cc=(9, 0))
        print("append", np.dtype(xdt).name, np.dtype(sdt).name,
              "fdiv" in cres.library.get_llvm_str())
"""


def test_real_kernels_lower_with_a_quantized_cache():
    from device_lowering import run_lowering

    lines = run_lowering(LOWERING).splitlines()
    assert lines == ["quant float32 float32 True", "quant float32 float16 True",
                     "quant float64 float32 True", "float True",
                     "append float32 float32 True", "append float16 float16 True",
                     "append int16 float32 True", "append float64 float16 True"], lines
