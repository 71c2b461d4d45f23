"""sdpa_numba.jax.varlen_attention: the CPU varlen kernels as XLA FFI calls under jax.jit,
jax.grad and jax.vmap.

Bit for bit the NumPy API's forward and backward on the same arrays (the same kernels), and
against the per-sequence float64 reference (tests/varlen_checks.py). Few specializations
(each a compiled handler): float64 forward and backward, float32 forward and backward,
float16 and bfloat16 forward.
"""

import re

import numpy as np
import pytest

jax = pytest.importorskip("jax")
jax.config.update("jax_enable_x64", True)
import jax.numpy as jnp  # noqa: E402

import sdpa_numba  # noqa: E402
from sdpa_numba.jax import varlen_attention  # noqa: E402
from mod_functions import MODS, tilt_grad  # noqa: E402
from varlen_checks import cu, packed, reference_forward, reference_grads  # noqa: E402

# odd sizes; an empty query sequence and one without keys
LQ, LK = [3, 0, 5, 2], [4, 2, 6, 0]
HQ, H, E, EV = 4, 2, 5, 3

CASES = {
    "causal": dict(is_causal=True),
    "window_bottom_right": dict(window=(2, 1), alignment="bottom_right"),
    "softcap_chunk": dict(softcap=1.5, scale=0.7, chunk=2),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_forward_and_grad_float64(rng, case):
    kw = CASES[case]
    q, k, v = packed(rng, LQ, LK, HQ, H, E, EV)
    cq, ck = cu(LQ), cu(LK, np.int64)  # int32 and int64 cu_seqlens
    f = jax.jit(lambda q, k, v, a, b: varlen_attention(q, k, v, a, b, return_lse=True, **kw))
    out, lse = f(q, k, v, cq, ck)  # cu_seqlens traced
    want, want_lse = sdpa_numba.varlen_attention(q, k, v, cq, ck, return_lse=True, **kw)
    np.testing.assert_array_equal(out, want)
    np.testing.assert_array_equal(lse, want_lse)
    ro, rl = reference_forward(q, k, v, cq, ck, **kw)
    np.testing.assert_allclose(out, ro, rtol=0, atol=1e-12)
    np.testing.assert_allclose(lse, rl, rtol=0, atol=1e-12)

    g = rng.standard_normal(out.shape)
    grads = jax.jit(jax.grad(lambda q, k, v, a, b: jnp.sum(varlen_attention(q, k, v, a, b, **kw)
                                                          * g), argnums=(0, 1, 2)))(
        q, k, v, cq, ck)
    numpy_grads = sdpa_numba.varlen_attention_backward(g, q, k, v, want, want_lse, cq, ck, **kw)
    ref = reference_grads(g, q, k, v, cq, ck, **kw)
    for got, exact, r in zip(grads, numpy_grads, ref):
        np.testing.assert_array_equal(got, exact)
        np.testing.assert_allclose(got, r, rtol=0, atol=1e-12)


def test_float32_grad_and_narrow_forward(rng):
    q, k, v = packed(rng, LQ, LK, HQ, H, E, EV, np.float32)
    cq, ck = cu(LQ), cu(LK)
    out = jax.jit(lambda q, k, v: varlen_attention(q, k, v, cq, ck, is_causal=True))(q, k, v)
    assert out.dtype == np.float32
    np.testing.assert_array_equal(out, sdpa_numba.varlen_attention(q, k, v, cq, ck,
                                                                   is_causal=True))
    g = jax.grad(lambda q: jnp.sum(varlen_attention(q, k, v, cq, ck) ** 2))(q)
    assert g.dtype == np.float32
    o, lse = sdpa_numba.varlen_attention(q, k, v, cq, ck, return_lse=True)
    np.testing.assert_array_equal(
        g, sdpa_numba.varlen_attention_backward(2 * o, q, k, v, o, lse, cq, ck)[0])
    for dtype in ("float16", "bfloat16"):
        dt = jnp.dtype(dtype)
        qn, kn, vn = (jnp.asarray(x).astype(dt) for x in (q, k, v))
        out, lse = jax.jit(lambda q, k, v: varlen_attention(q, k, v, cq, ck, is_causal=True,
                                                            return_lse=True))(qn, kn, vn)
        assert out.dtype == dt and lse.dtype == np.float32
        want, want_lse = sdpa_numba.varlen_attention(
            np.asarray(qn), np.asarray(kn), np.asarray(vn), cq, ck, is_causal=True,
            return_lse=True)
        np.testing.assert_array_equal(np.asarray(out).view(np.uint16), want.view(np.uint16))
        np.testing.assert_array_equal(lse, want_lse)


def test_vmap(rng):
    # mapped q, k, v and cu_seqlens (each entry its own split of the rows); grad under vmap
    lq, lk = [[2, 3], [5, 0], [1, 4]], [[3, 3], [4, 2], [6, 0]]
    q = np.stack([packed(rng, a, b, HQ, H, E, EV)[0] for a, b in zip(lq, lk)])
    k = rng.standard_normal((3, 6, H, E))
    v = rng.standard_normal((3, 6, H, EV))
    cq = np.stack([cu(a) for a in lq])
    ck = np.stack([cu(b) for b in lk])
    f = jax.jit(jax.vmap(lambda q, k, v, a, b: varlen_attention(q, k, v, a, b,
                                                                 is_causal=True)))
    out = f(q, k, v, cq, ck)
    for n in range(3):
        np.testing.assert_array_equal(out[n], sdpa_numba.varlen_attention(
            q[n], k[n], v[n], cq[n], ck[n], is_causal=True))
    # k, v shared (not mapped): broadcast to every entry
    g = jax.jit(jax.vmap(jax.grad(lambda q, a: jnp.sum(varlen_attention(q, k[0], v[0], a,
                                                                        ck[0]) ** 2))))(q, cq)
    for n in range(3):
        o, lse = sdpa_numba.varlen_attention(q[n], k[0], v[0], cq[n], ck[0], return_lse=True)
        np.testing.assert_array_equal(g[n], sdpa_numba.varlen_attention_backward(
            2 * o, q[n], k[0], v[0], o, lse, cq[n], ck[0])[0])


def test_no_python_callback(rng):
    q, k, v = packed(rng, LQ, LK, HQ, H, E, EV)
    cq, ck = cu(LQ), cu(LK)
    text = jax.jit(lambda q, k, v, a, b: jax.grad(
        lambda q: jnp.sum(varlen_attention(q, k, v, a, b)))(q)).lower(q, k, v, cq, ck).as_text()
    assert re.search(r"custom_call @sdpa_numba_varlen_forward_\d+", text)
    assert re.search(r"custom_call @sdpa_numba_varlen_backward_\d+", text)
    assert "callback" not in text


@pytest.mark.parametrize("bad", ["q_dims", "heads", "dtype", "cu_dtype", "cu_shape",
                                 "cu_count", "max_type"])
def test_bad_input_at_trace_time(rng, bad):
    q, k, v = packed(rng, LQ, LK, HQ, H, E, EV)
    cq, ck = cu(LQ), cu(LK)
    kw = {}
    if bad == "q_dims":
        q = q[None]
    elif bad == "heads":
        k, v = k[:, :1].repeat(3, 1), v[:, :1].repeat(3, 1)
    elif bad == "dtype":
        v = v.astype(np.float32)
    elif bad == "cu_dtype":
        cq = cq.astype(np.float32)
    elif bad == "cu_shape":
        ck = ck[None]
    elif bad == "cu_count":
        ck = cu(LK[:3] + [0, 0])
    elif bad == "max_type":
        kw = dict(max_seqlen_q=2.5)
    with pytest.raises((TypeError, ValueError)) as e:
        sdpa_numba.varlen_attention(q, k, v, cq, ck, **kw)
    kind, msg = type(e.value), str(e.value)
    f = jax.jit(lambda q, k, v, a, b: varlen_attention(q, k, v, a, b, **kw))
    with pytest.raises(kind) as e:
        f.trace(q, k, v, cq, ck)  # cu_seqlens traced: shapes and dtypes only
    if bad != "max_type":  # (a static int under JAX: its own message)
        assert str(e.value) == msg
    else:
        assert "max_seqlen_q" in str(e.value)
    if bad == "cu_count":  # concrete values: the NumPy API's message, at trace time
        with pytest.raises(ValueError, match=re.escape(msg)):
            varlen_attention(q, k, v, cq, ck)


@pytest.mark.parametrize("bad, name", [
    ("start", "cu_seqlens_q must start at 0"), ("decrease", "cu_seqlens_k must not decrease"),
    ("end", "cu_seqlens_q must end at q's total rows"),
    ("max", "max_seqlen_k is smaller than the longest sequence of cu_seqlens_k")])
def test_bad_cu_seqlens_values_when_the_kernel_runs(rng, bad, name):
    q, k, v = packed(rng, LQ, LK, HQ, H, E, EV)
    cq, ck = cu(LQ), cu(LK)
    kw = {}
    if bad == "start":
        cq = cq + 1
    elif bad == "decrease":
        ck = ck.copy()
        ck[2] = 1
    elif bad == "end":
        cq = cq.copy()
        cq[-1] -= 1
    else:
        kw = dict(max_seqlen_k=5)
    f = jax.jit(lambda q, k, v, a, b: varlen_attention(q, k, v, a, b, **kw))
    with pytest.raises(Exception, match=re.escape(name)):
        jax.block_until_ready(f(q, k, v, cq, ck))
    # and outside jit, concrete: the NumPy API's checks at trace time
    with pytest.raises(ValueError):
        varlen_attention(q, k, v, cq, ck, **kw)


def test_alibi_and_sinks(rng):
    # (B, Hq) slopes and sinks (one -inf): forward and grads bit for bit the NumPy API's,
    # against the float64 reference; sinks' gradient; vmap over q, cu_seqlens and sinks
    q, k, v = packed(rng, LQ, LK, HQ, H, E, EV)
    cq, ck = cu(LQ), cu(LK, np.int64)
    alibi = rng.random((len(LQ), HQ))
    sinks = rng.standard_normal(HQ)
    sinks[1] = -np.inf
    kw = dict(is_causal=True, alignment="bottom_right")

    def f(q, k, v, a, b, sinks):
        return varlen_attention(q, k, v, a, b, alibi_slopes=alibi, sinks=sinks, **kw)

    out = jax.jit(f)(q, k, v, cq, ck, sinks)
    want, want_lse = sdpa_numba.varlen_attention(q, k, v, cq, ck, return_lse=True,
                                                 alibi_slopes=alibi, sinks=sinks, **kw)
    np.testing.assert_array_equal(out, want)
    ro, _ = reference_forward(q, k, v, cq, ck, alibi_slopes=alibi, sinks=sinks, **kw)
    np.testing.assert_allclose(out, ro, rtol=0, atol=1e-12)
    g = rng.standard_normal(out.shape)
    grads = jax.jit(jax.grad(lambda *a: jnp.sum(f(*a) * g), argnums=(0, 1, 2, 5)))(
        q, k, v, cq, ck, sinks)
    exact = sdpa_numba.varlen_attention_backward(g, q, k, v, want, want_lse, cq, ck,
                                                 alibi_slopes=alibi, sinks=sinks, **kw)
    ref = reference_grads(g, q, k, v, cq, ck, alibi_slopes=alibi, sinks=sinks, **kw)
    for got, e in zip(grads[:3], exact):
        np.testing.assert_array_equal(got, e)
    np.testing.assert_allclose(grads[3], exact[3], rtol=1e-13, atol=1e-14)
    for got, r in zip(grads, ref):
        np.testing.assert_allclose(got, r, rtol=0, atol=1e-12)
    ds = np.asarray(grads[3])
    assert ds[1] == 0 and np.all(ds[[0, 2, 3]] != 0)
    # vmap: each entry as the unmapped call
    qs, ss = np.stack([q, q[::-1]]), np.stack([sinks, sinks[::-1]])
    mapped = jax.jit(jax.vmap(lambda q, s: f(q, k, v, cq, ck, s)))(qs, ss)
    for n in range(2):
        np.testing.assert_array_equal(mapped[n], sdpa_numba.varlen_attention(
            qs[n], k, v, cq, ck, alibi_slopes=alibi, sinks=ss[n], **kw))
    with pytest.raises(NotImplementedError, match="alibi_slopes"):
        jax.grad(lambda a: jnp.sum(varlen_attention(q, k, v, cq, ck, alibi_slopes=a,
                                                    sinks=sinks, **kw)))(alibi)
    with pytest.raises(ValueError, match="alibi_slopes of shape"):
        jax.jit(lambda q: varlen_attention(q, k, v, cq, ck, alibi_slopes=alibi[:, :2])).trace(q)


def test_dropout(rng):
    # a JAX key: the NumPy API's mask for its seed, forward and grads bit for bit; vmap with
    # one key draws the unmapped call's mask in every entry
    q, k, v = packed(rng, LQ, LK, HQ, H, E, EV)
    cq, ck = cu(LQ), cu(LK)
    key = jax.random.key(11)
    seed = int(np.asarray(jax.random.bits(key, (2,), jnp.uint32)).view(np.uint64)[0])
    kw = dict(is_causal=True, dropout_p=0.25)

    def f(q, k, v, key):
        return varlen_attention(q, k, v, cq, ck, dropout_rng=key, **kw)

    out = jax.jit(f)(q, k, v, key)
    want, lse = sdpa_numba.varlen_attention(q, k, v, cq, ck, seed=seed, return_lse=True, **kw)
    np.testing.assert_array_equal(out, want)
    assert not np.allclose(out, sdpa_numba.varlen_attention(q, k, v, cq, ck, is_causal=True))
    g = rng.standard_normal(out.shape)
    grads = jax.jit(jax.grad(lambda *a: jnp.sum(f(*a) * g), argnums=(0, 1, 2)))(q, k, v, key)
    for got, exp in zip(grads, sdpa_numba.varlen_attention_backward(
            g, q, k, v, want, lse, cq, ck, seed=seed, **kw)):
        np.testing.assert_array_equal(got, exp)
    np.testing.assert_array_equal(
        jax.jit(lambda q: varlen_attention(q, k, v, cq, ck, seed=seed, **kw))(q), want)
    qs = np.stack([q, 2 * q])
    mapped = jax.jit(jax.vmap(lambda q: f(q, k, v, key)))(qs)
    for n in range(2):
        np.testing.assert_array_equal(mapped[n], sdpa_numba.varlen_attention(
            qs[n], k, v, cq, ck, seed=seed, **kw))
    with pytest.raises(ValueError, match="dropout_rng"):
        jax.jit(lambda q: varlen_attention(q, k, v, cq, ck, **kw)).trace(q)


def test_score_mod_and_mask_mod(rng):
    # The shared score_mod / mask_mod pair (tests/mod_functions.py) with traced mod_args:
    # the NumPy API's forward and backward bit for bit; b is the sequence index.
    q, k, v = packed(rng, LQ, LK, HQ, H, E, EV)
    cq, ck = cu(LQ), cu(LK)
    slopes = rng.standard_normal(HQ)
    ids = np.sort(rng.integers(0, 2, (len(LQ), max(LQ + LK))), axis=1).astype(np.int32)
    kw = dict(is_causal=True, alignment="bottom_right", **MODS)

    def f(q, k, v, slopes, ids):
        return varlen_attention(q, k, v, cq, ck, mod_args=(slopes, ids, 0.5),
                                score_mod_grad=tilt_grad, return_lse=True, **kw)

    out, lse = jax.jit(f)(q, k, v, slopes, ids)
    args = (slopes, ids, 0.5)
    want, want_lse = sdpa_numba.varlen_attention(q, k, v, cq, ck, return_lse=True,
                                                 mod_args=args, **kw)
    np.testing.assert_array_equal(out, want)
    np.testing.assert_array_equal(lse, want_lse)
    # the functions do change the result (the test can fail)
    assert not np.allclose(want, sdpa_numba.varlen_attention(
        q, k, v, cq, ck, is_causal=True, alignment="bottom_right"))
    g = rng.standard_normal(out.shape)
    grads = jax.jit(jax.grad(lambda *a: jnp.sum(f(*a)[0] * g), argnums=(0, 1, 2)))(
        q, k, v, slopes, ids)
    numpy_grads = sdpa_numba.varlen_attention_backward(
        g, q, k, v, want, want_lse, cq, ck, mod_args=args, score_mod_grad=tilt_grad, **kw)
    for got, exact in zip(grads, numpy_grads):
        np.testing.assert_array_equal(got, exact)
    # vmap over q and the ids: each entry its own mod_args (the same compiled handler)
    idss = np.stack([ids, ids[:, ::-1].copy()])
    qs = np.stack([q, 2 * q])
    got = jax.jit(jax.vmap(lambda q, ids: varlen_attention(
        q, k, v, cq, ck, mod_args=(slopes, ids, 0.5), **kw)))(qs, idss)
    for n in range(2):
        np.testing.assert_array_equal(got[n], sdpa_numba.varlen_attention(
            qs[n], k, v, cq, ck, mod_args=(slopes, idss[n], 0.5), **kw))
    # no score_mod_grad: the gradient is refused; the mod_args have none
    with pytest.raises(ValueError, match="score_mod_grad"):
        jax.grad(lambda q: jnp.sum(varlen_attention(q, k, v, cq, ck, mod_args=args,
                                                    **kw)))(q)
    with pytest.raises(NotImplementedError, match="mod_args"):
        jax.grad(lambda s: jnp.sum(varlen_attention(q, k, v, cq, ck, mod_args=(s, ids, 0.5),
                                                    score_mod_grad=tilt_grad, **kw)))(slopes)
    with pytest.raises(TypeError, match=r"score_mod must take \d+ arguments \(score"):
        jax.jit(lambda q: varlen_attention(q, k, v, cq, ck, mod_args=args[:2],
                                           **MODS)).trace(q)


def test_not_taken(rng):
    q, k, v = packed(rng, LQ, LK, HQ, H, E, EV)
    cq, ck = cu(LQ), cu(LK)
    for kw, what in ((dict(out=np.empty((10, HQ, EV))), "out"),):
        with pytest.raises(NotImplementedError, match=what):
            varlen_attention(q, k, v, cq, ck, **kw)
    with pytest.raises(NotImplementedError, match="lse"):
        jax.grad(lambda q: jnp.sum(varlen_attention(q, k, v, cq, ck, return_lse=True)[1]))(q)
