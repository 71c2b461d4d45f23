"""Quantized KV caches (int8 per token and head, q8_0, fp8 e4m3fn / e5m2): the CPU decode
kernel against the float64 reference over the dequantized cache (the float32 cache's
tolerance), appends quantized in place, the refusals with nothing written, and the
quantize / dequantize functions (rounding, saturation, zero blocks, from users' @njit code).

Compiled specializations kept few: float32 queries and float32 scales for most tests (every
format is one specialization), the variants with the int8 format only."""

import ml_dtypes
import numba
import numpy as np
import pytest

import sdpa_numba.cpu.launch_decode as launch_decode
from checks import TOL
from kvcache_checks import VARIANTS, at_thread_counts, check_against_reference, paged_pair
from sdpa_numba import attention_with_kvcache as kvattn
from sdpa_numba import kvcache_plan
from sdpa_numba.cpu.decode import CHUNK
from sdpa_numba.quant import (dequantize_kv, float_to_fp8, fp8_to_float32, quantize_blocks,
                              quantize_fp8, quantize_kv)

FORMATS = ["int8", "q8_0", "e4m3fn", "e5m2"]
F32 = TOL[np.float32]


def quantized(rng, fmt, B, S, H, E, Ev, scale_dtype=np.float32, per_head=True):
    """Random caches quantized to ``fmt``: (kq, ks, vq, vs, k64, v64), the last two the
    float64 dequantized caches the reference reads."""
    kc = rng.standard_normal((B, S, H, E)).astype(np.float32) * 2
    vc = rng.standard_normal((B, S, H, Ev)).astype(np.float32)
    kq, ks = quantize_kv(kc, fmt, scale_dtype=scale_dtype, per_head=per_head)
    vq, vs = quantize_kv(vc, fmt, scale_dtype=scale_dtype, per_head=per_head)
    return (kq, ks, vq, vs, dequantize_kv(kq, ks, dtype=np.float64),
            dequantize_kv(vq, vs, dtype=np.float64))


def _bytes(*arrays):
    return [np.array(a).tobytes() for a in arrays]


@pytest.mark.parametrize("fmt", FORMATS)
def test_formats_against_reference_gqa_split_leftpad(rng, fmt):
    # Sequences: empty, one key, fewer keys than query tokens, one split into chunks; left
    # padding; GQA; Lq = 3 (chunked prefill).
    B, Lq, Hq, H, E, Ev, S = 4, 3, 4, 2, 64, 32, CHUNK + 70
    kq, ks, vq, vs, k64, v64 = quantized(rng, fmt, B, S, H, E, Ev)
    q = rng.standard_normal((B, Lq, Hq, E)).astype(np.float32)
    seqlens = np.array([0, 1, 2, CHUNK + 61], np.int32)
    leftpad = np.array([0, 0, 1, 40])
    before = _bytes(kq, ks, vq, vs)
    out = np.full((B, Lq, Hq, Ev), np.nan, np.float32)
    res, lse = kvattn(q, kq, vq, seqlens, k_scale=ks, v_scale=vs, cache_leftpad=leftpad,
                      return_lse=True, out=out)
    assert res is out
    assert _bytes(kq, ks, vq, vs) == before  # no append: nothing written
    check_against_reference(q, k64, v64, seqlens, out, lse, True, leftpad=leftpad, tol=F32)


@pytest.mark.parametrize("fmt", FORMATS)
def test_vector_loops_against_reference(rng, fmt):
    # E = Ev = 128: the vectorized score and P V loops that fold the scales in (1 row x LANES
    # keys for MHA, 4 rows x KB keys for GQA, blocks of 32 for q8_0), with the rows (Lq = 5:
    # four and one) and keys (blocks of 32 cut at 77 and 600 keys) they leave to the scalar
    # loops.
    B, H, E = 2, 2, 128
    kq, ks, vq, vs, k64, v64 = quantized(rng, fmt, B, 600, H, E, E)
    seqlens = np.array([77, 600], np.int32)
    for hq, lq in ((2, 1), (2, 5), (8, 1)):
        q = rng.standard_normal((B, lq, hq, E)).astype(np.float32)
        out = np.full((B, lq, hq, E), np.nan, np.float32)
        _, lse = kvattn(q, kq, vq, seqlens, k_scale=ks, v_scale=vs, return_lse=True, out=out)
        check_against_reference(q, k64, v64, seqlens, out, lse, True, tol=F32)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("page_size", [64, 48])
def test_mha_vector_loops_paged_against_reference(rng, fmt, page_size):
    # Fewer than four rows a head (MHA, Lq = 1, 2, 3), E = Ev = 128 (the vector loops), the
    # scales of a block read row by row across pages (pages of 64: blocks within a page; of
    # 48: every other block straddles two), a shuffled block table, lengths that cut blocks,
    # pages and a chunk.
    B, H, E = 2, 3, 128
    n_pages = (CHUNK + 60 + page_size - 1) // page_size
    kc = rng.standard_normal((B * n_pages, page_size, H, E)).astype(np.float32) * 2
    vc = rng.standard_normal((B * n_pages, page_size, H, E)).astype(np.float32)
    kq, ks = quantize_kv(kc, fmt)
    vq, vs = quantize_kv(vc, fmt)
    k64 = dequantize_kv(kq, ks, dtype=np.float64)
    v64 = dequantize_kv(vq, vs, dtype=np.float64)
    table = rng.permutation(B * n_pages).astype(np.int32).reshape(B, n_pages)
    seqlens = np.array([CHUNK + 59, 2 * page_size + 7], np.int32)
    for lq in (1, 2, 3):
        q = rng.standard_normal((B, lq, H, E)).astype(np.float32)
        out = np.full((B, lq, H, E), np.nan, np.float32)
        _, lse = kvattn(q, kq, vq, seqlens, k_scale=ks, v_scale=vs, block_table=table,
                        return_lse=True, out=out)
        check_against_reference(q, k64, v64, seqlens, out, lse, True, table=table, tol=F32)


@pytest.mark.parametrize("fmt,page_size", [("int8", 1), ("q8_0", 3), ("e4m3fn", 1),
                                           ("e5m2", 4)])
def test_paged_append_quantizes_into_the_slots(rng, fmt, page_size):
    B, Hq, H, E, new = 2, 4, 2, 32, 5
    S = 8 * page_size
    kq, ks, vq, vs, _, _ = quantized(rng, fmt, B, S, H, E, E, per_head=True)
    pk, pv, table = paged_pair(rng, kq.view(np.int8).astype(np.float32),
                               vq.view(np.int8).astype(np.float32), page_size)
    pk = np.nan_to_num(pk).astype(np.int8).view(kq.dtype)
    pv = np.nan_to_num(pv).astype(np.int8).view(vq.dtype)
    if fmt in ("int8", "q8_0"):  # the scales paged alike
        pks = np.zeros(pk.shape[:3] + ks.shape[3:], np.float32)
        pvs = np.zeros(pk.shape[:3] + vs.shape[3:], np.float32)
        for b in range(B):
            for p in range(table.shape[1]):
                pks[table[b, p]] = ks[b, p * page_size:(p + 1) * page_size]
                pvs[table[b, p]] = vs[b, p * page_size:(p + 1) * page_size]
    else:
        pks, pvs = ks, vs
    seqlens = np.array([2 * page_size - 1, page_size + 1])  # appends start mid-page
    q = rng.standard_normal((B, 2, Hq, E)).astype(np.float32)
    kn = rng.standard_normal((B, new, H, E)).astype(np.float32)
    vn = rng.standard_normal((B, new, H, E)).astype(np.float32)
    before = [x.copy() for x in (pk, pv, pks, pvs)]
    out, lse = kvattn(q, pk, pv, seqlens, k=kn, v=vn, block_table=table, k_scale=pks,
                      v_scale=pvs, return_lse=True)
    # The new rows are exactly quantize_kv's (fp8: with the cache's descale, saturating).
    for x, cache, sc, old, old_sc in ((kn, pk, pks, before[0], before[2]),
                                      (vn, pv, pvs, before[1], before[3])):
        expect, expect_sc = old.copy(), np.array(old_sc, copy=True)
        for b in range(B):
            rows = x[b][None]  # (1, new, H, E)
            if fmt in ("int8", "q8_0"):
                rq, rs = quantize_kv(rows, fmt)
            else:
                rq = np.empty(rows.shape, np.uint8)
                quantize_fp8(rows, rq, np.broadcast_to(sc, (B, H))[b:b + 1],
                             1 if fmt == "e4m3fn" else 2)
                rq = rq.view(cache.dtype)
            for t in range(new):
                j = seqlens[b] + t
                expect[table[b, j // page_size], j % page_size] = rq[0, t]
                if fmt in ("int8", "q8_0"):
                    expect_sc[table[b, j // page_size], j % page_size] = rs[0, t]
        assert cache.tobytes() == expect.tobytes()
        assert np.array(sc).tobytes() == expect_sc.tobytes()
    if fmt in ("e4m3fn", "e5m2"):  # a per-(B, H) descale is per sequence: the reference's
        k64 = [dequantize_kv(pk, pks[b:b + 1].repeat(pk.shape[0], 0), dtype=np.float64)
               for b in range(B)]
        v64 = [dequantize_kv(pv, pvs[b:b + 1].repeat(pv.shape[0], 0), dtype=np.float64)
               for b in range(B)]
        for b in range(B):
            check_against_reference(q[b:b + 1], k64[b], v64[b], seqlens[b:b + 1] + new,
                                    out[b:b + 1], lse[b:b + 1], True, table=table[b:b + 1],
                                    tol=F32)
    else:
        k64 = dequantize_kv(pk, pks, dtype=np.float64)
        v64 = dequantize_kv(pv, pvs, dtype=np.float64)
        check_against_reference(q, k64, v64, seqlens + new, out, lse, True, table=table,
                                tol=F32)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_variants_see_the_true_score(rng, variant):
    # int8 per token: the scale folds into q . k before softcap, ALiBi and score_mod.
    B, Hq, H, E = 2, 4, 2, 32
    kq, ks, vq, vs, k64, v64 = quantized(rng, "int8", B, 40, H, E, E)
    q = rng.standard_normal((B, 2, Hq, E)).astype(np.float32)
    seqlens = np.array([40, 23])
    kw = VARIANTS[variant](rng, B, Hq)
    causal = kw.pop("is_causal", True)
    out, lse = kvattn(q, kq, vq, seqlens, k_scale=ks, v_scale=vs, is_causal=causal,
                      return_lse=True, **kw)
    check_against_reference(q, k64, v64, seqlens, out, lse, causal, tol=F32, **kw)


@pytest.mark.parametrize("dtype", [np.float16, ml_dtypes.bfloat16])
def test_narrow_queries_and_float16_scales(rng, dtype):
    # q8_0 with float16 scales (llama.cpp's layout), float16 / bfloat16 queries.
    kq, ks, vq, vs, k64, v64 = quantized(rng, "q8_0", 2, 70, 1, 64, 32,
                                         scale_dtype=np.float16)
    assert ks.dtype == np.float16
    q = rng.standard_normal((2, 2, 4, 64)).astype(dtype)
    seqlens = np.array([70, 31])
    out, lse = kvattn(q, kq, vq, seqlens, k_scale=ks, v_scale=vs, return_lse=True)
    assert out.dtype == dtype and lse.dtype == np.float32
    check_against_reference(q.astype(np.float32), k64, v64, seqlens,
                            out.astype(np.float64), lse, True,
                            tol=TOL[np.float16] if dtype == np.float16 else 5e-3)


def test_plan_runs_layers_with_their_scales_and_threads_do_not_matter(rng, monkeypatch):
    B, Hq, H, E = 2, 4, 2, 32
    layers = [quantized(rng, "q8_0", B, 2 * CHUNK + 5, H, E, E) for _ in range(2)]
    q = rng.standard_normal((B, 1, Hq, E)).astype(np.float32)
    seqlens = np.array([2 * CHUNK + 5, 9])
    kq, ks, vq, vs = layers[0][:4]
    plan = kvcache_plan(q, kq, vq, seqlens, k_scale=ks, v_scale=vs)
    for kq, ks, vq, vs, k64, v64 in layers:
        out, lse = plan.run(q, kq, vq, k_scale=ks, v_scale=vs, return_lse=True)
        check_against_reference(q, k64, v64, seqlens, out, lse, True, tol=F32)
    with pytest.raises(ValueError, match="k_scale of shape .* is not what the plan"):
        plan.run(q, kq, vq, k_scale=ks[:, 1:], v_scale=vs)
    with pytest.raises(ValueError, match="needs v_scale"):
        plan.run(q, kq, vq, k_scale=ks)
    # The parallel kernel: the same for 1 and 2 threads, bit for bit.
    monkeypatch.setattr(launch_decode, "SERIAL_BYTES", 0)
    results = at_thread_counts(lambda: kvattn(q, kq, vq, seqlens, k_scale=ks, v_scale=vs,
                                              return_lse=True))
    for out, lse in results[1:]:
        np.testing.assert_array_equal(out, results[0][0])
        np.testing.assert_array_equal(lse, results[0][1])
    check_against_reference(q, layers[1][4], layers[1][5], seqlens, *results[0], True,
                            tol=F32)


def test_bad_input_is_refused_with_nothing_written(rng):
    B, H, E = 2, 2, 64
    kq, ks, vq, vs, _, _ = quantized(rng, "q8_0", B, 8, H, E, E)
    q = rng.standard_normal((B, 1, 4, E)).astype(np.float32)
    kn = rng.standard_normal((B, 2, H, E)).astype(np.float32)
    sl = np.array([3, 4])
    fk, fks = quantize_kv(rng.standard_normal((B, 8, H, E)), "e4m3fn")
    kf = rng.standard_normal((B, 8, H, E)).astype(np.float32)
    cached = (kq, ks, vq, vs, fk, fks, kf)
    before = _bytes(*cached)

    def refused(exc, match, *args, **kw):
        with pytest.raises(exc, match=match):
            kvattn(*args, **kw)
        assert _bytes(*cached) == before

    app = dict(k=kn, v=kn)
    refused(ValueError, "needs k_scale", q, kq, vq, sl, **app)
    refused(ValueError, "needs v_scale", q, kq, vq, sl, k_scale=ks, **app)
    refused(ValueError, "k_scale is for a quantized cache", q, kf, kf, sl, k_scale=ks,
            v_scale=vs)
    refused(ValueError, r"k_scale of an int8 cache must have shape", q, kq, vq, sl,
            k_scale=ks[:, :, :, :1], v_scale=vs, **app)
    refused(ValueError, r"v_scale of an int8 cache", q, kq, vq, sl, k_scale=ks,
            v_scale=vs[:, :4], **app)
    refused(TypeError, "k_scale dtype float64 is not supported", q, kq, vq, sl,
            k_scale=ks.astype(np.float64), v_scale=vs, **app)
    refused(TypeError, "v_scale dtype float16 differs", q, kq, vq, sl, k_scale=ks,
            v_scale=vs.astype(np.float16), **app)
    refused(ValueError, "head dim must be a multiple of 32", q[..., :16], kq[..., :16],
            vq[..., :16], sl, k_scale=ks[..., :1], v_scale=vs[..., :1], **{
                "k": kn[..., :16], "v": kn[..., :16]})
    bad = ks.copy()
    bad[1, 7, 0, 0] = np.nan  # a slot not even read
    refused(ValueError, "k_scale must be finite", q, kq, vq, sl, k_scale=bad, v_scale=vs,
            **app)
    bad[1, 7, 0, 0] = np.inf
    refused(ValueError, "k_scale must be finite", q, kq, vq, sl, k_scale=bad, v_scale=vs)
    # float16 scales are checked by their bits: every non-finite pattern, either sign
    ks16, vs16 = ks.astype(np.float16), vs.astype(np.float16)
    before16 = _bytes(*cached, ks16, vs16)
    for bits in (0x7C00, 0xFC00, 0x7C01, 0x7E00, 0x7FFF, 0xFC01, 0xFE00, 0xFFFF):
        bad16 = vs16.copy()
        bad16.view(np.uint16)[0, 5, 1, 1] = bits
        with pytest.raises(ValueError, match="v_scale must be finite"):
            kvattn(q, kq, vq, sl, k_scale=ks16, v_scale=bad16)
        assert _bytes(*cached, ks16, vs16) == before16
    # ... and the largest finite ones pass
    big16 = vs16.copy()
    big16.view(np.uint16)[0, 5, 1] = (0x7BFF, 0xFBFF)
    kvattn(q, kq, vq, sl, k_scale=ks16, v_scale=big16)
    kbad = kn.copy()
    kbad[0, 1, 1, 3] = np.inf
    refused(ValueError, "k must be finite to be quantized", q, kq, vq, sl, k=kbad, v=kn,
            k_scale=ks, v_scale=vs)
    refused(TypeError, "v_cache dtype float8_e4m3fn differs from k_cache dtype int8", q, kq,
            fk, sl, k_scale=ks, v_scale=fks)
    refused(ValueError, r"k_scale of a e4m3fn cache must be a scalar or have shape \(B, H\)",
            q, fk, fk, sl, k_scale=np.ones(3, np.float32), v_scale=fks, **app)
    refused(ValueError, r"k_scale must be finite", q, fk, fk, sl, k_scale=np.inf,
            v_scale=fks, **app)
    ro = ks.copy()
    ro.flags.writeable = False
    refused(ValueError, "k_scale .* is read-only|k_scale must be writeable", q, kq, vq, sl,
            k_scale=ro, v_scale=vs, **app)
    refused(ValueError, r"beyond the cache's 8", q, kq, vq, np.array([7, 0]), k_scale=ks,
            v_scale=vs, **app)


def test_quantize_rounds_to_nearest_even_saturates_and_zero_blocks():
    # int8: a row of absmax 127 has scale 1; halves go to the even neighbour.
    x = np.zeros((1, 2, 1, 8), np.float32)
    x[0, 0, 0] = [127, 0.5, 1.5, 2.5, -2.5, -0.5, 3.49, -127]
    vals, sc = quantize_kv(x, "int8")
    assert sc[0, 0, 0] == 1 and sc[0, 1, 0] == 0  # the zero row: scale 0, values 0
    np.testing.assert_array_equal(vals[0, 0, 0], [127, 0, 2, 2, -2, 0, 3, -127])
    np.testing.assert_array_equal(vals[0, 1, 0], 0)
    np.testing.assert_array_equal(dequantize_kv(vals, sc), np.round(x))
    # q8_0: one scale per 32 values, a zero block among others.
    rng = np.random.default_rng(5)
    x = rng.standard_normal((2, 3, 2, 96)).astype(np.float32)
    x[1, 2, 1, 32:64] = 0
    vals, sc = quantize_kv(x, "q8_0")
    assert sc.shape == (2, 3, 2, 3) and sc[1, 2, 1, 1] == 0
    blocks = x.reshape(2, 3, 2, 3, 32)
    np.testing.assert_allclose(sc, np.abs(blocks).max(-1) / 127, rtol=1e-7)
    assert np.abs(vals).max() == 127
    err = np.abs(dequantize_kv(vals, sc, dtype=np.float64) - x).reshape(blocks.shape)
    assert (err <= sc[..., None] * (0.5 + 1e-6)).all()
    # float16 scales: quantized with the scale as stored.
    vals16, sc16 = quantize_kv(x, "q8_0", scale_dtype=np.float16)
    with np.errstate(invalid="ignore", divide="ignore"):
        expect = np.clip(np.rint(blocks / sc16.astype(np.float64)[..., None]), -127, 127)
    expect[sc16 == 0] = 0
    np.testing.assert_array_equal(vals16, expect.reshape(x.shape))


@pytest.mark.parametrize("fmt", ["e4m3fn", "e5m2"])
def test_fp8_encoding_is_ml_dtypes_rounding_saturated(fmt):
    dt = np.dtype(getattr(ml_dtypes, "float8_" + fmt))
    code = 1 if fmt == "e4m3fn" else 2
    top = float(ml_dtypes.finfo(dt).max)
    rng = np.random.default_rng(7)
    # Every value, every midpoint between neighbours (ties), random values over the range.
    every = np.arange(256, dtype=np.uint8).view(dt).astype(np.float64)
    every = np.sort(every[np.isfinite(every)])
    ties = (every[1:] + every[:-1]) / 2
    rand = np.ldexp(rng.uniform(-1, 1, 4000), rng.integers(-20, 17, 4000))
    y = np.concatenate([every, ties, rand]).astype(np.float32)
    y = y[np.abs(y) <= top]
    got = np.array([float_to_fp8(v, code) for v in y], np.uint8)
    np.testing.assert_array_equal(got, y.astype(dt).view(np.uint8))
    # Saturation where ml_dtypes gives inf / NaN; decoding back.
    assert float_to_fp8(np.float32(1e9), code) == float_to_fp8(np.float32(top), code)
    assert float_to_fp8(np.float32(-1e9), code) == 0x80 | float_to_fp8(np.float32(top), code)
    decoded = np.array([fp8_to_float32(np.uint8(b), code) for b in range(256)])
    np.testing.assert_array_equal(decoded, np.arange(256, dtype=np.uint8).view(dt)
                                  .astype(np.float32))
    # quantize_kv: descale absmax / top; the round trip within half a quantum.
    x = rng.standard_normal((2, 5, 3, 16))
    vals, d = quantize_kv(x, fmt)
    assert vals.dtype == dt and d.shape == () and d == np.float32(np.abs(x).max() / top)
    assert np.abs(vals.astype(np.float64)).max() == top
    vals, d = quantize_kv(x, fmt, per_head=True)
    assert d.shape == (2, 3)
    np.testing.assert_array_equal(vals, (x / d[:, None, :, None]).astype(np.float32)
                                  .astype(dt))
    zero, dz = quantize_kv(np.zeros((1, 2, 1, 4)), fmt)
    assert dz == 0 and (zero.view(np.uint8) == 0).all()


def test_quantize_from_a_users_njit_code():
    @numba.njit
    def quantize_and_sum(x):
        values = np.empty(x.shape, np.int8)
        scales = np.empty(x.shape[:3] + (x.shape[3] // 32,), np.float32)
        quantize_blocks(x, values, scales, False)
        bits = np.empty(x.shape, np.uint8)
        quantize_fp8(x, bits, np.ones((x.shape[0], x.shape[2]), np.float32), 1)
        return values, scales, bits, float_to_fp8(1.0, 2)

    x = np.random.default_rng(3).standard_normal((1, 3, 2, 64)).astype(np.float32)
    values, scales, bits, one = quantize_and_sum(x)
    vq, sq = quantize_kv(x, "q8_0")
    np.testing.assert_array_equal(values, vq)
    np.testing.assert_array_equal(scales, sq)
    np.testing.assert_array_equal(bits, x.astype(ml_dtypes.float8_e4m3fn).view(np.uint8))
    assert one == np.array(1.0, ml_dtypes.float8_e5m2).view(np.uint8)


@pytest.mark.parametrize("fmt", ["e4m3fn", "e5m2"])
@pytest.mark.parametrize("hq", [2, 8])
def test_every_fp8_pattern_read_by_the_kernel(rng, fmt, hq):
    # Every finite bit pattern (subnormals, both zeros, the largest) in the keys and values
    # that the vector loops read (E = 128, float32 queries) and in the keys left over to the
    # scalar loops (37 keys: 32 in vector passes), MHA (hq 2) and GQA (four rows a head);
    # then a NaN pattern in one key of head 1: that head's rows NaN, head 0's as before.
    dt = getattr(ml_dtypes, f"float8_{fmt}")
    every = np.arange(256, dtype=np.uint8)
    finite = every[np.isfinite(every.view(dt).astype(np.float32))]
    B, H, S, E = 1, 2, 37, 128
    kq = rng.choice(finite, (B, S, H, E)).astype(np.uint8)
    vq = rng.choice(finite, (B, S, H, E)).astype(np.uint8)
    kq[0, :2, 0] = np.resize(finite, (2, E))  # each pattern at least once in a key row
    kq[0, :2, 1] = np.resize(finite[::-1], (2, E))
    vq[0, 3:5, 1] = np.resize(finite, (2, E))
    top = float(ml_dtypes.finfo(dt).max)
    ks = np.array([[0.5 / top, 2.0 / top]], np.float32)  # (B, H): scores of order 1
    vs = np.array([[1.0, 0.25]], np.float32)
    q = rng.standard_normal((B, 1, hq, E)).astype(np.float32)
    seqlens = np.array([S])
    k64 = kq.view(dt).astype(np.float64) * ks[:, None, :, None]
    v64 = vq.view(dt).astype(np.float64) * vs[:, None, :, None]
    out, lse = kvattn(q, kq.view(dt), vq.view(dt), seqlens, k_scale=ks, v_scale=vs,
                      return_lse=True)
    check_against_reference(q, k64, v64, seqlens, out, lse, True, tol=F32)
    kq[0, 30, 1, 77] = 0x7F  # NaN in both formats
    nan_out = kvattn(q, kq.view(dt), vq.view(dt), seqlens, k_scale=ks, v_scale=vs)
    g = hq // H
    assert np.isnan(nan_out[0, 0, g:]).all()
    np.testing.assert_array_equal(nan_out[0, 0, :g], out[0, 0, :g])


_CACHED_DECODE = """
import sys, numpy as np
from sdpa_numba import attention_with_kvcache as f
from sdpa_numba.cpu import int_dots
assert int_dots.__file__ == sys.argv[2], int_dots.__file__
c = np.load(sys.argv[1])
o = f(c['q'], c['kq'], c['vq'], c['seqlens'], k_scale=c['ks'], v_scale=c['vs'])
print(o.tobytes().hex())
"""


def test_cached_decode_without_its_format_loops_in_the_cache(rng, tmp_path):
    # The cached decode calls _chunk, and _chunk each format's block loops, by symbol
    # (cpu/_llvm.by_symbol). A second process on the same cache loads them through reload
    # hooks; with the loops' cache entries gone it compiles them again, under other names than
    # those the cached _chunk was compiled against: the call must still resolve (not abort the
    # process) and give the same bits.
    import os
    import subprocess
    import sys

    from sdpa_numba.cpu import int_dots

    kq, ks, vq, vs, _, _ = quantized(rng, "int8", 1, 40, 2, 64, 64)
    q = rng.standard_normal((1, 1, 2, 64)).astype(np.float32)
    case = tmp_path / "case.npz"
    np.savez(case, q=q, kq=kq, vq=vq, ks=ks, vs=vs, seqlens=np.array([40], np.int32))
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(int_dots.__file__))))
    cache = tmp_path / "numba_cache"
    env = dict(os.environ, NUMBA_CACHE_DIR=str(cache), PYTHONPATH=root)

    def run():
        res = subprocess.run([sys.executable, "-c", _CACHED_DECODE, str(case),
                              int_dots.__file__], env=env, capture_output=True, text=True,
                             timeout=900)
        assert res.returncode == 0, res.stderr[-2000:]
        return res.stdout.strip().splitlines()[-1]

    first = run()
    loops = [p for p in cache.rglob("decode._*_int8-*")]
    assert loops and list(cache.rglob("decode._chunk-*"))
    for p in loops:
        p.unlink()
    assert run() == first
    assert first == kvattn(q, kq, vq, np.array([40], np.int32), k_scale=ks,
                           v_scale=vs).tobytes().hex()
