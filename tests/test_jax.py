"""sdpa_numba.jax: the CPU kernels as XLA FFI calls under jax.jit, jax.grad and jax.vmap.

Compared with a float64 jax.numpy attention written here (1e-12 in float64) and with
jax.nn.dot_product_attention (1e-5: it computes its softmax in float32 even for float64), and
bit for bit with the NumPy API on the same arrays. Few specializations (each is a compiled
handler): float64 without and with masks / ALiBi+sinks, float32, float16, bfloat16.
"""

import re

import numpy as np
import pytest

jax = pytest.importorskip("jax")
jax.config.update("jax_enable_x64", True)
import jax.numpy as jnp  # noqa: E402

import sdpa_numba  # noqa: E402
from sdpa_numba.jax import scaled_dot_product_attention  # noqa: E402

attention = scaled_dot_product_attention


def reference(q, k, v, mask=None, is_causal=False, scale=None, gqa=False, window=None,
              alignment="top_left", softcap=None, alibi=None, sinks=None):
    """Attention in jax.numpy, float64: (..., H, L, E) layout, the NumPy API's semantics."""
    q, k, v = (jnp.asarray(x, jnp.float64) for x in (q, k, v))
    L, S = q.shape[-2], k.shape[-2]
    if gqa:
        rep = q.shape[-3] // k.shape[-3]
        k, v = jnp.repeat(k, rep, axis=-3), jnp.repeat(v, rep, axis=-3)
    scale = 1 / np.sqrt(q.shape[-1]) if scale is None else scale
    s = jnp.einsum("...le,...se->...ls", q, k) * scale
    if softcap is not None:
        s = softcap * jnp.tanh(s / softcap)
    i = jnp.arange(L)[:, None] + (S - L if alignment == "bottom_right" else 0)
    j = jnp.arange(S)[None, :]
    if alibi is not None:
        s = s - jnp.asarray(alibi, jnp.float64)[..., None, None] * jnp.abs(i - j)
    keep = jnp.ones((L, S), bool)
    if is_causal:
        keep &= j <= i
    if window is not None:
        left, right = window
        if left is not None:
            keep &= j >= i - left
        if right is not None:
            keep &= j <= i + right
    if mask is not None:
        if mask.dtype == bool:
            keep = keep & mask
        else:
            s = s + mask
    s = jnp.where(keep, s, -jnp.inf)
    m = s.max(axis=-1, keepdims=True)
    if sinks is not None:
        m = jnp.maximum(m, jnp.asarray(sinks, jnp.float64)[:, None, None])
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    p = jnp.exp(s - m)
    den = p.sum(axis=-1, keepdims=True)
    if sinks is not None:
        den = den + jnp.exp(jnp.asarray(sinks, jnp.float64)[:, None, None] - m)
    p = p / jnp.where(den > 0, den, 1.0)
    return jnp.einsum("...ls,...sd->...ld", p, v)


def qkv(rng, b=2, hq=3, h=3, L=5, S=7, E=9, Ev=6, dtype=np.float64):
    return (rng.standard_normal((b, hq, L, E)).astype(dtype),
            rng.standard_normal((b, h, S, E)).astype(dtype),
            rng.standard_normal((b, h, S, Ev)).astype(dtype))


CASES = {  # name: (kwargs, extras(rng) -> kwargs with arrays)
    "dense": dict(),
    "causal": dict(is_causal=True),
    "window": dict(window=(2, 1)),
    "bottom_right_causal": dict(is_causal=True, alignment="bottom_right"),
    "softcap": dict(softcap=1.5, scale=0.7),
}


def _ref_kwargs(kw):
    return {("gqa" if k == "enable_gqa" else "alibi" if k == "alibi_slopes" else
             "mask" if k == "attn_mask" else k): v for k, v in kw.items()}


@pytest.mark.parametrize("case", sorted(CASES))
def test_forward_and_grad_float64(rng, case):
    kw = CASES[case]
    q, k, v = qkv(rng)
    f = jax.jit(lambda q, k, v: attention(q, k, v, **kw))
    out = f(q, k, v)
    want = reference(q, k, v, **_ref_kwargs(kw))
    np.testing.assert_allclose(out, want, rtol=0, atol=1e-12)
    # bit for bit the NumPy API's numbers (the same kernel)
    np.testing.assert_array_equal(out, sdpa_numba.scaled_dot_product_attention(q, k, v, **kw))
    w = rng.standard_normal(out.shape)

    def loss(fn):
        return lambda q, k, v: jnp.sum(fn(q, k, v) * w)

    got = jax.jit(jax.grad(loss(lambda *a: attention(*a, **kw)), argnums=(0, 1, 2)))(q, k, v)
    exp = jax.grad(loss(lambda *a: reference(*a, **_ref_kwargs(kw))), argnums=(0, 1, 2))(q, k, v)
    for g, e in zip(got, exp):
        np.testing.assert_allclose(g, e, rtol=0, atol=1e-12)


def test_gqa_masks_and_jax_nn(rng):
    # GQA with a padding (bool) mask, causal; against jax.nn (B, T, N, H layout) at 1e-5.
    q, k, v = qkv(rng, hq=6, h=2, L=5, S=5, Ev=9)
    lengths = np.array([5, 3])
    pad = (np.arange(5)[None, :] < lengths[:, None])[:, None, None, :]  # (B, 1, 1, S)
    kw = dict(attn_mask=pad, enable_gqa=True, is_causal=True)
    out = jax.jit(lambda q, k, v, m: attention(q, k, v, attn_mask=m, enable_gqa=True,
                                               is_causal=True))(q, k, v, pad)
    np.testing.assert_allclose(out, reference(q, k, v, **_ref_kwargs(kw)), rtol=0, atol=1e-12)
    t = lambda x: jnp.swapaxes(jnp.asarray(x), 1, 2)  # noqa: E731
    nn = jax.nn.dot_product_attention(t(q), t(k), t(v), mask=jnp.swapaxes(pad, 1, 2)
                                      .transpose(0, 2, 1, 3), is_causal=True)
    np.testing.assert_allclose(out, t(nn), rtol=0, atol=1e-5)
    w = rng.standard_normal(out.shape)
    got = jax.jit(jax.grad(lambda q, k, v: jnp.sum(attention(q, k, v, **kw) * w),
                           argnums=(0, 1, 2)))(q, k, v)
    exp = jax.grad(lambda q, k, v: jnp.sum(reference(q, k, v, **_ref_kwargs(kw)) * w),
                   argnums=(0, 1, 2))(q, k, v)
    for g, e in zip(got, exp):
        np.testing.assert_allclose(g, e, rtol=0, atol=1e-12)


def test_additive_mask_gradient(rng):
    q, k, v = qkv(rng, b=1)
    bias = rng.standard_normal((1, 1, 5, 7))  # broadcast over heads: its gradient is summed
    w = rng.standard_normal((1, 3, 5, 6))

    def loss(fn):
        return lambda q, k, v, m: jnp.sum(fn(q, k, v, m) * w)

    ours = loss(lambda q, k, v, m: attention(q, k, v, attn_mask=m))
    ref = loss(lambda q, k, v, m: reference(q, k, v, mask=m))
    got = jax.jit(jax.grad(ours, argnums=(0, 1, 2, 3)))(q, k, v, bias)
    exp = jax.grad(ref, argnums=(0, 1, 2, 3))(q, k, v, bias)
    for g, e in zip(got, exp):
        assert g.shape == e.shape
        np.testing.assert_allclose(g, e, rtol=0, atol=1e-12)
    # without asking for the mask's gradient (the other result count: a specialization)
    got = jax.jit(jax.grad(ours, argnums=(0,)))(q, k, v, bias)
    np.testing.assert_allclose(got[0], exp[0], rtol=0, atol=1e-12)


def test_alibi_and_sinks(rng):
    q, k, v = qkv(rng, hq=4, h=4)
    slopes = np.array([0.5, 0.25, 0.125, 0.0625])
    sinks = np.array([0.3, -np.inf, 1.0, -0.5])
    kw = dict(alibi_slopes=slopes, sinks=sinks, is_causal=True)
    out = jax.jit(lambda q, k, v, a, s: attention(q, k, v, alibi_slopes=a, sinks=s,
                                                  is_causal=True))(q, k, v, slopes, sinks)
    np.testing.assert_allclose(out, reference(q, k, v, **_ref_kwargs(kw)), rtol=0, atol=1e-12)
    np.testing.assert_array_equal(out, sdpa_numba.scaled_dot_product_attention(q, k, v, **kw))
    w = rng.standard_normal(out.shape)

    def loss(fn):
        return lambda q, k, v, s: jnp.sum(fn(q, k, v, s) * w)

    ours = loss(lambda q, k, v, s: attention(q, k, v, alibi_slopes=slopes, sinks=s,
                                             is_causal=True))
    ref = loss(lambda q, k, v, s: reference(q, k, v, alibi=slopes, sinks=s, is_causal=True))
    got = jax.jit(jax.grad(ours, argnums=(0, 1, 2, 3)))(q, k, v, sinks)
    exp = jax.grad(ref, argnums=(0, 1, 2, 3))(q, k, v, sinks)
    for g, e in zip(got, exp):
        np.testing.assert_allclose(g, e, rtol=0, atol=1e-12)
    with pytest.raises(NotImplementedError, match="alibi_slopes"):
        jax.grad(lambda a: jnp.sum(attention(q, k, v, alibi_slopes=a)))(slopes)


def test_vmap(rng):
    # vmap over query and value with a shared key; 3-D inputs (no batch dim); grad under vmap
    q = rng.standard_normal((4, 2, 5, 9))
    k = rng.standard_normal((2, 7, 9))
    v = rng.standard_normal((4, 2, 7, 6))
    f = jax.jit(jax.vmap(lambda q, v: attention(q, k, v, is_causal=True)))
    out = f(q, v)
    want = np.stack([reference(q[n], k, v[n], is_causal=True) for n in range(4)])
    np.testing.assert_allclose(out, want, rtol=0, atol=1e-12)
    g = jax.jit(jax.vmap(jax.grad(lambda q, v: jnp.sum(attention(q, k, v) ** 2))))(q, v)
    ge = jax.vmap(jax.grad(lambda q, v: jnp.sum(reference(q, k, v) ** 2)))(q, v)
    np.testing.assert_allclose(g, ge, rtol=0, atol=1e-12)
    # vmap of vmap, and a batched bool mask against unbatched q
    m = rng.random((3, 4, 5, 7)) > 0.3
    m[..., 0] = True
    qq = rng.standard_normal((2, 5, 9))
    out = jax.vmap(jax.vmap(lambda m, v: attention(qq, k, v, attn_mask=m)), in_axes=(0, None))(
        m, v)
    want = np.stack([np.stack([reference(qq, k, v[b], mask=m[a, b]) for b in range(4)])
                     for a in range(3)])
    np.testing.assert_allclose(out, want, rtol=0, atol=1e-12)


def test_float32_against_jax_nn(rng):
    q, k, v = qkv(rng, L=6, S=6, E=8, Ev=8, dtype=np.float32)
    t = lambda x: jnp.swapaxes(jnp.asarray(x), 1, 2)  # noqa: E731
    for causal in (False, True):
        out = jax.jit(lambda q, k, v: attention(q, k, v, is_causal=causal))(q, k, v)
        assert out.dtype == np.float32
        nn = t(jax.nn.dot_product_attention(t(q), t(k), t(v), is_causal=causal))
        nn_xla = t(jax.nn.dot_product_attention(t(q), t(k), t(v), is_causal=causal,
                                                implementation="xla"))
        np.testing.assert_allclose(out, nn, rtol=0, atol=1e-5)
        np.testing.assert_allclose(out, nn_xla, rtol=0, atol=1e-5)
        np.testing.assert_array_equal(
            out, sdpa_numba.scaled_dot_product_attention(q, k, v, is_causal=causal))
    g = jax.jit(jax.grad(lambda q: jnp.sum(attention(q, k, v) ** 2)))(q)
    gn = jax.grad(lambda q: jnp.sum(t(jax.nn.dot_product_attention(t(q), t(k), t(v))) ** 2))(q)
    assert g.dtype == np.float32
    np.testing.assert_allclose(g, gn, rtol=0, atol=1e-5)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_narrow_dtypes(rng, dtype):
    dt = jnp.dtype(dtype)
    q, k, v = (x.astype(dt) for x in qkv(rng, dtype=np.float32))
    out, lse = jax.jit(lambda q, k, v: attention(q, k, v, is_causal=True,
                                                 return_lse=True))(q, k, v)
    assert out.dtype == dt and lse.dtype == np.float32
    want, want_lse = sdpa_numba.scaled_dot_product_attention(
        np.asarray(q), np.asarray(k), np.asarray(v), is_causal=True, return_lse=True)
    np.testing.assert_array_equal(np.asarray(out).view(np.uint16), want.view(np.uint16))
    np.testing.assert_array_equal(lse, want_lse)


def test_no_python_callback(rng):
    q, k, v = qkv(rng)
    text = jax.jit(lambda q, k, v: attention(q, k, v)).lower(q, k, v).as_text()
    assert re.search(r"stablehlo\.custom_call @sdpa_numba_forward_\d+", text)
    assert "callback" not in text
    g = jax.jit(jax.grad(lambda q: jnp.sum(attention(q, k, v)))).lower(q).as_text()
    assert re.search(r"custom_call @sdpa_numba_backward_\d+", g)
    assert "callback" not in g


def _numpy_error(fn):
    with pytest.raises((TypeError, ValueError)) as e:
        fn()
    return type(e.value), str(e.value)


@pytest.mark.parametrize("bad", ["dtype", "shape", "heads", "mask", "scale", "window",
                                 "sinks"])
def test_bad_input_at_trace_time(rng, bad):
    q, k, v = qkv(rng)
    kw = {}
    if bad == "dtype":
        k = k.astype(np.float32)
    elif bad == "shape":
        v = v[:, :, :4]
    elif bad == "heads":
        kw = dict(enable_gqa=True)
        k, v = k[:, :2], v[:, :2]
    elif bad == "mask":
        kw = dict(attn_mask=np.ones((5, 6), bool))
    elif bad == "scale":
        kw = dict(scale=float("inf"))
    elif bad == "window":
        kw = dict(window=(-1, 0))
    elif bad == "sinks":
        kw = dict(sinks=np.zeros(4))
    kind, msg = _numpy_error(lambda: sdpa_numba.scaled_dot_product_attention(q, k, v, **kw))
    arrays = {n: x for n, x in kw.items() if isinstance(x, np.ndarray)}
    others = {n: x for n, x in kw.items() if n not in arrays}
    f = jax.jit(lambda q, k, v, arrays: attention(q, k, v, **arrays, **others))
    with pytest.raises(kind) as e:
        f.trace(q, k, v, arrays)  # tracing alone: nothing compiled, nothing run
    assert str(e.value) == msg


@__import__("numba").njit
def _all_keys(b, h, i, j):
    return True


def test_not_built_yet(rng):
    q, k, v = qkv(rng)
    bm = sdpa_numba.create_block_mask(_all_keys, 1, 1, 5, 7)
    with pytest.raises(NotImplementedError, match="block_mask"):
        attention(q, k, v, block_mask=bm)
    with pytest.raises(NotImplementedError, match="lse"):
        jax.grad(lambda q: jnp.sum(attention(q, k, v, return_lse=True)[1]))(q)


def test_handler_error_reaches_the_caller():
    # The handlers' failure path (sdpa_numba.jax._frame.error): a handler that always fails.
    from numba import cfunc, types

    from sdpa_numba.jax._frame import answer_metadata, c_string, error

    message = c_string("the test handler failed on purpose")

    @cfunc(types.intp(types.intp))
    def failing(frame):
        if answer_metadata(frame):
            return 0
        return error(frame, message)

    jax.ffi.register_ffi_target("sdpa_numba_test_failing", jax.ffi.pycapsule(failing.address),
                                platform="cpu")
    x = jnp.ones(3)
    f = jax.jit(lambda x: jax.ffi.ffi_call("sdpa_numba_test_failing",
                                           jax.ShapeDtypeStruct(x.shape, x.dtype))(x))
    with pytest.raises(Exception, match="the test handler failed on purpose"):
        jax.block_until_ready(f(x))


X32 = """
import numpy as np, jax, jax.numpy as jnp
import sdpa_numba
from sdpa_numba.jax import scaled_dot_product_attention as attention
assert not jax.config.jax_enable_x64
rng = np.random.default_rng(0)
q, k, v = (rng.standard_normal((2, 3, 5, 8)).astype(np.float32) for _ in range(3))
out = jax.jit(lambda q, k, v: attention(q, k, v, is_causal=True, window=(3, None)))(q, k, v)
want = sdpa_numba.scaled_dot_product_attention(q, k, v, is_causal=True, window=(3, None))
np.testing.assert_array_equal(out, want)
# float64 NumPy input is float32 to JAX without x64: the result is float32's
out = jax.jit(attention)(q.astype(np.float64), k, v)
assert out.dtype == np.float32
np.testing.assert_array_equal(out, sdpa_numba.scaled_dot_product_attention(q, k, v))
print("ok")
"""


def test_without_x64():
    # JAX's default: no 64-bit arrays (the kernels' numbers travel as bytes)
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "JAX_ENABLE_X64"}
    r = subprocess.run([sys.executable, "-c", X32], capture_output=True, text=True, env=env,
                       timeout=900)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stdout + r.stderr
