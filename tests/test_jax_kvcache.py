"""sdpa_numba.jax.attention_with_kvcache: the decode kernel and the append as one XLA FFI call,
functional (the caches come back, aliased to the inputs).

Bit for bit the NumPy API on the same arrays (the same kernel) and against the per-sequence
float64 reference (tests/kvcache_checks.py). Few specializations (each a compiled handler):
float64 with and without an append, float32, float16 and bfloat16 with one.
"""

import re

import numpy as np
import pytest

jax = pytest.importorskip("jax")
jax.config.update("jax_enable_x64", True)
import jax.numpy as jnp  # noqa: E402

import sdpa_numba  # noqa: E402
from kvcache_checks import check_against_reference, paged_pair  # noqa: E402
from mod_functions import MODS  # noqa: E402
from sdpa_numba.jax import attention_with_kvcache  # noqa: E402

B, S, H, HQ, E, EV = 3, 11, 2, 4, 5, 3


def arrays(rng, lq=2, lq_new=2, dtype=np.float64):
    q = rng.standard_normal((B, lq, HQ, E)).astype(dtype)
    kc = rng.standard_normal((B, S, H, E)).astype(dtype)
    vc = rng.standard_normal((B, S, H, EV)).astype(dtype)
    k = rng.standard_normal((B, lq_new, H, E)).astype(dtype)
    v = rng.standard_normal((B, lq_new, H, EV)).astype(dtype)
    return q, kc, vc, k, v


def numpy_call(q, kc, vc, lens, **kw):
    """The NumPy API on copies: ``(out, lse, k_cache, v_cache)``."""
    kc, vc = np.array(kc), np.array(vc)
    out, lse = sdpa_numba.attention_with_kvcache(np.asarray(q), kc, vc, np.asarray(lens),
                                                 return_lse=True, **kw)
    return out, lse, kc, vc


@pytest.mark.parametrize("kw", [dict(), dict(window=(3, 0), softcap=2.0),
                                dict(is_causal=False, scale=0.6, chunk=4)],
                         ids=["causal", "window_softcap", "chunk"])
def test_append_float64(rng, kw):
    q, kc, vc, k, v = arrays(rng)
    lens = np.array([0, 4, 9], np.int32)  # the last append fills the cache
    kc0, vc0 = kc.copy(), vc.copy()
    f = jax.jit(lambda q, kc, vc, lens, k, v: attention_with_kvcache(
        q, kc, vc, lens, k=k, v=v, return_lse=True, **kw))
    out, kc2, vc2, lse = f(q, kc, vc, lens, k, v)
    want, want_lse, wkc, wvc = numpy_call(q, kc, vc, lens, k=k, v=v, **kw)
    for got, exp in ((out, want), (lse, want_lse), (kc2, wkc), (vc2, wvc)):
        np.testing.assert_array_equal(got, exp)
    check_against_reference(q, wkc, wvc, lens + 2, np.asarray(out), np.asarray(lse),
                            kw.get("is_causal", True), scale=kw.get("scale"),
                            **{n: x for n, x in kw.items() if n not in ("is_causal", "scale")})
    # the inputs (NumPy arrays, and jax arrays not donated) are unchanged
    np.testing.assert_array_equal(kc, kc0)
    np.testing.assert_array_equal(vc, vc0)
    jkc, jvc = jnp.asarray(kc), jnp.asarray(vc)
    jax.block_until_ready(f(q, jkc, jvc, lens, k, v))
    np.testing.assert_array_equal(jkc, kc0)
    np.testing.assert_array_equal(jvc, vc0)


def test_no_append_leftpad_and_int_seqlens(rng):
    q, kc, vc, _, _ = arrays(rng, lq=1)
    lens = np.array([5, 11, 3], np.int64)
    pad = np.array([1, 0, 3], np.int32)  # the last sequence: no keys (zeros, lse -inf)
    out, kc2, vc2, lse = jax.jit(lambda q, kc, vc, l, p: attention_with_kvcache(
        q, kc, vc, l, cache_leftpad=p, return_lse=True))(q, kc, vc, lens, pad)
    want, want_lse, _, _ = numpy_call(q, kc, vc, lens, cache_leftpad=pad)
    np.testing.assert_array_equal(out, want)
    np.testing.assert_array_equal(lse, want_lse)
    np.testing.assert_array_equal(kc2, kc)
    check_against_reference(q, kc, vc, lens, np.asarray(out), np.asarray(lse), True,
                            leftpad=pad)
    out = attention_with_kvcache(q, kc, vc, 7)[0]  # an int: every sequence's length
    np.testing.assert_array_equal(out, numpy_call(q, kc, vc, np.full(B, 7))[0])


def test_paged(rng):
    q, kc, vc, k, v = arrays(rng, lq=3, lq_new=3)
    pk, pv, table = paged_pair(rng, kc, vc, 4)
    lens = np.array([2, 5, 8], np.int32)
    out, pk2, pv2 = jax.jit(lambda q, pk, pv, l, t, k, v: attention_with_kvcache(
        q, pk, pv, l, k=k, v=v, block_table=t))(q, pk, pv, lens, table, k, v)
    want, _, wpk, wpv = numpy_call(q, pk, pv, lens, k=k, v=v, block_table=table)
    np.testing.assert_array_equal(out, want)
    np.testing.assert_array_equal(pk2, wpk)  # (NaN pages: equal NaNs compare equal)
    np.testing.assert_array_equal(pv2, wpv)


def test_donated_caches_are_not_copied(rng):
    q, kc, vc, k, v = arrays(rng)
    lens = np.array([1, 2, 3], np.int32)
    f = jax.jit(lambda q, kc, vc, lens, k, v: attention_with_kvcache(q, kc, vc, lens, k=k,
                                                                     v=v),
                donate_argnums=(1, 2))
    jkc, jvc = jnp.asarray(kc), jnp.asarray(vc)
    addresses = jkc.unsafe_buffer_pointer(), jvc.unsafe_buffer_pointer()
    out, kc2, vc2 = f(q, jkc, jvc, lens, k, v)
    assert (kc2.unsafe_buffer_pointer(), vc2.unsafe_buffer_pointer()) == addresses
    assert jkc.is_deleted() and jvc.is_deleted()
    want, _, wkc, wvc = numpy_call(q, kc, vc, lens, k=k, v=v)
    np.testing.assert_array_equal(out, want)
    np.testing.assert_array_equal(kc2, wkc)
    np.testing.assert_array_equal(vc2, wvc)
    text = jax.jit(lambda q, kc, vc, lens, k, v: attention_with_kvcache(
        q, kc, vc, lens, k=k, v=v)).lower(q, kc, vc, lens, k, v).as_text()
    assert re.search(r"custom_call @sdpa_numba_kvcache_\d+", text)
    assert "output_operand_aliases" in text and "callback" not in text


def test_decode_loop(rng):
    # a jitted decode loop: one token per step appended and attended (lax.fori_loop), against
    # the NumPy API step by step
    steps = 4
    q, kc, vc, _, _ = arrays(rng, lq=1)
    qs = rng.standard_normal((steps, B, 1, HQ, E))
    ks = rng.standard_normal((steps, B, 1, H, E))
    vs = rng.standard_normal((steps, B, 1, H, EV))
    lens0 = np.array([0, 3, 7], np.int32)

    @jax.jit
    def loop(kc, vc, lens):
        def step(t, carry):
            kc, vc, lens, outs = carry
            out, kc, vc = attention_with_kvcache(jnp.asarray(qs)[t], kc, vc, lens,
                                                 k=jnp.asarray(ks)[t], v=jnp.asarray(vs)[t])
            return kc, vc, lens + 1, outs.at[t].set(out)
        outs = jnp.zeros((steps, B, 1, HQ, EV))
        return jax.lax.fori_loop(0, steps, step, (kc, vc, lens, outs))

    kc2, vc2, lens, outs = loop(kc, vc, lens0)
    wkc, wvc = kc.copy(), vc.copy()
    for t in range(steps):
        want = sdpa_numba.attention_with_kvcache(qs[t], wkc, wvc, lens0 + t, k=ks[t], v=vs[t])
        np.testing.assert_array_equal(outs[t], want)
    np.testing.assert_array_equal(kc2, wkc)
    np.testing.assert_array_equal(vc2, wvc)
    np.testing.assert_array_equal(lens, lens0 + steps)


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_dtypes(rng, dtype):
    dt = jnp.dtype(dtype)
    q, kc, vc, k, v = (jnp.asarray(x).astype(dt) for x in arrays(rng, dtype=np.float32))
    lens = np.array([3, 0, 6], np.int32)
    out, kc2, vc2, lse = jax.jit(lambda q, kc, vc, l, k, v: attention_with_kvcache(
        q, kc, vc, l, k=k, v=v, return_lse=True))(q, kc, vc, lens, k, v)
    assert out.dtype == dt and kc2.dtype == dt and lse.dtype == np.float32
    want, want_lse, wkc, _ = numpy_call(*(np.asarray(x) for x in (q, kc, vc)), lens,
                                        k=np.asarray(k), v=np.asarray(v))
    bits = (lambda x: np.asarray(x).view(np.uint16)) if dt.itemsize == 2 else np.asarray
    np.testing.assert_array_equal(bits(out), bits(want))
    np.testing.assert_array_equal(bits(kc2), bits(wkc))
    np.testing.assert_array_equal(lse, want_lse)


@pytest.mark.parametrize("bad", ["q_dims", "cache_dtype", "heads", "k_shape", "seqlens_shape",
                                 "seqlens_dtype", "alignment"])
def test_bad_input_at_trace_time(rng, bad):
    q, kc, vc, k, v = arrays(rng)
    lens = np.array([1, 2, 3], np.int32)
    kw = {}
    if bad == "q_dims":
        q = q[0]
    elif bad == "cache_dtype":
        vc = vc.astype(np.float32)
    elif bad == "heads":
        kc, vc = kc[:, :, :1].repeat(3, 2), vc[:, :, :1].repeat(3, 2)
    elif bad == "k_shape":
        k = k[:2]
    elif bad == "seqlens_shape":
        lens = lens[:2]
    elif bad == "seqlens_dtype":
        lens = lens.astype(np.float32)
    elif bad == "alignment":
        kw = dict(alignment="top_left")
    with pytest.raises((TypeError, ValueError)) as e:
        numpy_call(q, kc, vc, lens, k=k, v=v, **kw)
    kind, msg = type(e.value), str(e.value)
    f = jax.jit(lambda q, kc, vc, l, k, v: attention_with_kvcache(q, kc, vc, l, k=k, v=v, **kw))
    with pytest.raises(kind) as e:
        f.trace(q, kc, vc, lens, k, v)
    assert str(e.value) == msg


@pytest.mark.parametrize("bad, message", [
    ("past_end", "cache_seqlens + Lq_new is beyond the cache's slots"),
    ("negative", "cache_seqlens must be >= 0"),
    ("leftpad", "cache_leftpad must be in"),
    ("table", "block_table has an entry among the pages in use outside"),
    ("shared", "the append would write into a page that block_table lists more than once")])
def test_bad_values_when_the_kernel_runs(rng, bad, message):
    # traced integer arguments: the handler refuses before anything is written, and the error
    # reaches the caller; the same values given concretely fail at trace time (NumPy's checks)
    q, kc, vc, k, v = arrays(rng)
    lens = np.array([1, 2, 3], np.int32)
    pad = np.zeros(B, np.int32)
    table = None
    if bad == "past_end":
        lens[1] = S - 1  # + 2 new keys: one past the end
    elif bad == "negative":
        lens[0] = -1
    elif bad == "leftpad":
        pad[2] = 6
    elif bad in ("table", "shared"):
        kc, vc, table = paged_pair(rng, kc, vc, 4)
        table = table.copy()
        if bad == "table":
            table[1, 0] = kc.shape[0]
        else:
            table[2, 0] = table[0, 0]  # page of sequence 0's append, read by sequence 2
    jkc, jvc = jnp.asarray(kc), jnp.asarray(vc)
    f = jax.jit(lambda q, kc, vc, l, p, t, k, v: attention_with_kvcache(
        q, kc, vc, l, k=k, v=v, cache_leftpad=p, block_table=t))
    with pytest.raises(Exception, match=re.escape(message)) as e:
        jax.block_until_ready(f(q, jkc, jvc, lens, pad, table, k, v))
    assert "nothing was written" in str(e.value)
    np.testing.assert_array_equal(jkc, kc)
    np.testing.assert_array_equal(jvc, vc)
    with pytest.raises(ValueError):
        attention_with_kvcache(q, kc, vc, lens, k=k, v=v, cache_leftpad=pad, block_table=table)


def test_alibi_and_sinks(rng):
    # (B, Hq) slopes and sinks (one -inf), traced, with an append: the NumPy API's bits
    q, kc, vc, k, v = arrays(rng)
    lens = np.array([0, 4, 9], np.int32)
    alibi = rng.random((B, HQ))
    sinks = rng.standard_normal(HQ)
    sinks[2] = -np.inf
    f = jax.jit(lambda q, kc, vc, lens, k, v, a, s: attention_with_kvcache(
        q, kc, vc, lens, k=k, v=v, return_lse=True, alibi_slopes=a, sinks=s))
    out, kc2, vc2, lse = f(q, kc, vc, lens, k, v, alibi, sinks)
    want, want_lse, wkc, wvc = numpy_call(q, kc, vc, lens, k=k, v=v, alibi_slopes=alibi,
                                          sinks=sinks)
    for got, exp in ((out, want), (lse, want_lse), (kc2, wkc), (vc2, wvc)):
        np.testing.assert_array_equal(got, exp)
    check_against_reference(q, wkc, wvc, lens + 2, np.asarray(out), np.asarray(lse), True,
                            alibi_slopes=alibi, sinks=sinks)
    # new values, the same compiled call
    out2 = f(q, kc, vc, lens, k, v, 2 * alibi, sinks - 1)[0]
    np.testing.assert_array_equal(out2, numpy_call(q, kc, vc, lens, k=k, v=v,
                                                   alibi_slopes=2 * alibi,
                                                   sinks=sinks - 1)[0])
    with pytest.raises(ValueError, match="sinks of shape"):
        jax.jit(lambda q: attention_with_kvcache(q, kc, vc, lens, sinks=sinks[:3])).trace(q)


def test_score_mod_and_mask_mod(rng):
    # The shared score_mod / mask_mod pair (tests/mod_functions.py) with traced mod_args and
    # an append: the NumPy API's out, lse and caches bit for bit (positions in the cache's
    # frame).
    q, kc, vc, k, v = arrays(rng)
    lens = np.array([0, 4, 9], np.int32)
    slopes = rng.standard_normal(HQ)
    ids = np.sort(rng.integers(0, 2, (B, S)), axis=1).astype(np.int32)
    f = jax.jit(lambda q, kc, vc, lens, k, v, slopes, ids: attention_with_kvcache(
        q, kc, vc, lens, k=k, v=v, return_lse=True, mod_args=(slopes, ids, 0.5), **MODS))
    got = f(q, kc, vc, lens, k, v, slopes, ids)
    want, want_lse, wkc, wvc = numpy_call(q, kc, vc, lens, k=k, v=v,
                                          mod_args=(slopes, ids, 0.5), **MODS)
    for a, b in zip(got, (want, wkc, wvc, want_lse)):
        np.testing.assert_array_equal(a, b)
    assert not np.allclose(want, numpy_call(q, kc, vc, lens, k=k, v=v)[0])
    # new values, the same compiled call
    ids2 = ids[:, ::-1].copy()
    np.testing.assert_array_equal(f(q, kc, vc, lens, k, v, -slopes, ids2)[0],
                                  numpy_call(q, kc, vc, lens, k=k, v=v,
                                             mod_args=(-slopes, ids2, 0.5), **MODS)[0])
    with pytest.raises(TypeError, match=r"score_mod must take \d+ arguments \(score"):
        jax.jit(lambda q: attention_with_kvcache(q, kc, vc, lens, mod_args=(slopes,),
                                                 **MODS)).trace(q)


def _quantized(rng, fmt, e=32, ev=64, b=B, scale_dtype=np.float32, per_head=True):
    """float32 q, k, v and caches quantized to ``fmt`` (E, Ev multiples of 32: q8_0's)."""
    from sdpa_numba.quant import quantize_kv

    q = rng.standard_normal((b, 2, HQ, e)).astype(np.float32)
    k = rng.standard_normal((b, 2, H, e)).astype(np.float32)
    v = rng.standard_normal((b, 2, H, ev)).astype(np.float32)
    kc, ks = quantize_kv(2 * rng.standard_normal((b, S, H, e)), fmt, scale_dtype=scale_dtype,
                         per_head=per_head)
    vc, vs = quantize_kv(rng.standard_normal((b, S, H, ev)), fmt, scale_dtype=scale_dtype,
                         per_head=per_head)
    return q, k, v, kc, vc, ks, vs


def _bits(x):
    x = np.asarray(x)
    return x.view(np.uint8 if x.dtype.itemsize == 1 else np.uint16 if x.dtype.itemsize == 2
                  else np.uint32)


@pytest.mark.parametrize("fmt", ["int8", "q8_0", "e4m3fn", "e5m2"])
def test_quantized_cache_append(rng, fmt):
    # An append quantizes k, v into the caches (and, int8 / q8_0, their scales: aliased
    # results) and the kernel reads them dequantized: the NumPy API's bits, every result.
    q, k, v, kc, vc, ks, vs = _quantized(rng, fmt)
    lens = np.array([0, 4, 9], np.int32)
    f = jax.jit(lambda q, kc, vc, lens, k, v, ks, vs: attention_with_kvcache(
        q, kc, vc, lens, k=k, v=v, k_scale=ks, v_scale=vs, return_lse=True))
    got = f(q, kc, vc, lens, k, v, ks, vs)
    assert len(got) == 6
    wkc, wvc, wks, wvs = (np.array(x) for x in (kc, vc, ks, vs))
    want, want_lse = sdpa_numba.attention_with_kvcache(q, wkc, wvc, lens, k=k, v=v,
                                                       k_scale=wks, v_scale=wvs,
                                                       return_lse=True)
    for a, b in zip(got, (want, wkc, wvc, wks, wvs, want_lse)):
        assert np.asarray(a).dtype == b.dtype and a.shape == b.shape
        np.testing.assert_array_equal(_bits(a), _bits(b))
    assert not np.array_equal(_bits(wkc), _bits(kc))  # the append wrote (the test can fail)
    if fmt == "int8":
        assert not np.array_equal(wks, ks)
        # no append: the scales are read from the operands, not written
        out, *rest = jax.jit(lambda q, kc, vc, ks, vs: attention_with_kvcache(
            q, kc, vc, lens, k_scale=ks, v_scale=vs))(q, kc, vc, ks, vs)
        np.testing.assert_array_equal(out, sdpa_numba.attention_with_kvcache(
            q, kc, vc, lens, k_scale=ks, v_scale=vs))
        for a, b in zip(rest, (kc, vc, ks, vs)):
            np.testing.assert_array_equal(_bits(a), _bits(b))
        # a scale that is not finite: the call fails when it runs, nothing written
        bad = ks.copy()
        bad[0, 0, 0] = np.nan
        jkc = jnp.asarray(kc)
        with pytest.raises(Exception, match="k_scale must be finite"):
            jax.block_until_ready(f(q, jkc, vc, lens, k, v, bad, vs))
        k_bad = k.copy()
        k_bad[1, 0, 0, 0] = np.inf
        with pytest.raises(Exception, match="k must be finite to be quantized into a int8"):
            jax.block_until_ready(f(q, jkc, vc, lens, k_bad, v, ks, vs))
        np.testing.assert_array_equal(jkc, kc)
    if fmt == "e4m3fn":
        # a per-tensor descale given as a Python float, kept
        out, *_, kd, vd = jax.jit(lambda q, kc, vc, k, v: attention_with_kvcache(
            q, kc, vc, lens, k=k, v=v, k_scale=0.5, v_scale=0.25))(q, kc, vc, k, v)
        wkc = np.array(kc)
        np.testing.assert_array_equal(out, sdpa_numba.attention_with_kvcache(
            q, wkc, np.array(vc), lens, k=k, v=v, k_scale=0.5, v_scale=0.25))
        assert float(kd) == 0.5 and float(vd) == 0.25


@pytest.mark.parametrize("bad, kind, match", [
    ("float_cache", ValueError, "k_scale is for a quantized cache"),
    ("scale_shape", ValueError, r"k_scale of an int8 cache must have shape \(N, S, H\)"),
    ("scale_dtype", TypeError, "k_scale dtype float64 is not supported"),
    ("q8_0_dim", ValueError, "a q8_0 cache's head dim must be a multiple of 32"),
    ("fp8_shape", ValueError, r"k_scale of a e4m3fn cache must be a scalar or have shape"),
    ("no_scale", ValueError, "needs v_scale"),
])
def test_quantized_bad_input_at_trace_time(rng, bad, kind, match):
    q, k, v, kc, vc, ks, vs = _quantized(rng, "int8")
    lens = np.array([0, 4, 9], np.int32)
    kw = dict(k=k, v=v, k_scale=ks, v_scale=vs)
    if bad == "float_cache":
        kc, vc = (rng.standard_normal(x.shape).astype(np.float32) for x in (kc, vc))
    elif bad == "scale_shape":
        kw["k_scale"] = ks[:, :-1]
    elif bad == "scale_dtype":
        kw["k_scale"] = ks.astype(np.float64)
    elif bad == "q8_0_dim":
        kc, vc = kc[..., :24], vc[..., :24]
        q, kw["k"], kw["v"] = q[..., :24], k[..., :24], v[..., :24]
        kw.update(k_scale=np.ones((B, S, H, 1), np.float32),
                  v_scale=np.ones((B, S, H, 1), np.float32))
    elif bad == "fp8_shape":
        q, k, v, kc, vc, ks, vs = _quantized(rng, "e4m3fn")
        kw = dict(k=k, v=v, k_scale=ks[:, :1], v_scale=vs)
    elif bad == "no_scale":
        kw["v_scale"] = None
    with pytest.raises(kind, match=match):
        jax.jit(lambda q: attention_with_kvcache(q, kc, vc, lens, **kw)).trace(q)
    # and the NumPy API's own message, word for word
    with pytest.raises(kind, match=match):
        sdpa_numba.attention_with_kvcache(q, np.array(kc), np.array(vc), lens,
                                          **{n: None if x is None else np.array(x)
                                             for n, x in kw.items()})


def test_not_taken_and_vmap(rng):
    q, kc, vc, k, v = arrays(rng)
    lens = np.array([1, 2, 3], np.int32)
    for kw, what in ((dict(out=np.empty((B, 2, HQ, EV))), "out"),):
        with pytest.raises(NotImplementedError, match=what):
            attention_with_kvcache(q, kc, vc, lens, **kw)
    with pytest.raises(NotImplementedError, match="vmap"):
        jax.vmap(lambda q: attention_with_kvcache(q, kc, vc, lens))(q[None])
