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


def test_not_taken_and_vmap(rng):
    q, kc, vc, k, v = arrays(rng)
    lens = np.array([1, 2, 3], np.int32)
    for kw, what in ((dict(out=np.empty((B, 2, HQ, EV))), "out"),
                     (dict(k_scale=1.0), "k_scale")):
        with pytest.raises(NotImplementedError, match=what):
            attention_with_kvcache(q, kc, vc, lens, **kw)
    with pytest.raises(NotImplementedError, match="vmap"):
        jax.vmap(lambda q: attention_with_kvcache(q, kc, vc, lens))(q[None])
