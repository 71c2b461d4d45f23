"""Chunked local attention (``chunk=c``) on the CUDA kernels (simulator): dense forward and
backward, varlen, and the decode kernel, against the float64 reference; keys that no query's
chunk holds are NaN, so a kernel that visited their blocks would give NaN rows. (The KV-cache
variants' shared test, ``kvcache_checks.VARIANTS["chunk"]``, covers paged caches and appends.)
Sizes are tiny and odd; conftest's 4 x 4 blocks make them span several blocks."""

import numpy as np
import pytest

import sdpa_numba
from sdpa_cuda_testing import dev, rel_err
from sdpa_numba import reference, varlen_attention, varlen_attention_backward
from varlen_checks import cu, packed, reference_forward, reference_grads


def _host(x):
    return x if isinstance(x, np.ndarray) else x.copy_to_host()


@pytest.mark.parametrize("shape, kw", [
    ((1, 2, 2, 13, 17), dict(chunk=5, is_causal=True)),
    ((1, 4, 2, 9, 14), dict(chunk=3, alignment="bottom_right", window=(2, 1),
                            enable_gqa=True)),
    ((1, 2, 2, 11, 6), dict(chunk=4, alignment="bottom_right")),  # rows at negative positions
], ids=["causal", "window_gqa_bottom_right", "l_past_s"])
def test_dense_forward_backward(rng, shape, kw):
    B, Hq, H, L, S = shape
    q = rng.standard_normal((B, Hq, L, 5))
    k = rng.standard_normal((B, H, S, 5))
    v = rng.standard_normal((B, H, S, 3))
    out, lse = sdpa_numba.scaled_dot_product_attention(dev(q), dev(k), dev(v),
                                                       return_lse=True, **kw)
    ro, rl = reference.attention(q, k, v, **kw)
    o, lg = out.copy_to_host(), lse.copy_to_host()
    assert rel_err(o, ro) < 1e-12
    fin = np.isfinite(rl)
    assert (np.isfinite(lg) == fin).all() and rel_err(lg[fin], rl[fin]) < 1e-12
    g = rng.standard_normal(o.shape)
    grads = sdpa_numba.scaled_dot_product_attention_backward(dev(g), dev(q), dev(k), dev(v),
                                                             out, lse, **kw)
    for x, y in zip(grads, reference.attention_backward(g, q, k, v, **kw)[:3]):
        assert rel_err(_host(x), y) < 1e-10


@pytest.mark.parametrize("alignment", ["top_left", "bottom_right"])
def test_keys_outside_every_chunk_are_not_read(rng, alignment):
    L, S, c = 4, 24, 8
    q = rng.standard_normal((1, 2, L, 5))
    k = rng.standard_normal((1, 2, S, 5))
    v = rng.standard_normal((1, 2, S, 3))
    unseen = slice(c, S) if alignment == "top_left" else slice(0, S - c)
    kp, vp = k.copy(), v.copy()
    kp[:, :, unseen] = np.nan
    vp[:, :, unseen] = np.nan
    kw = dict(chunk=c, is_causal=True, alignment=alignment)
    out, lse = sdpa_numba.scaled_dot_product_attention(dev(q), dev(kp), dev(vp),
                                                       return_lse=True, **kw)
    assert rel_err(out.copy_to_host(), reference.attention(q, k, v, **kw)[0]) < 1e-12
    g = rng.standard_normal((1, 2, L, 3))
    dq, dk, dv = (_host(x) for x in sdpa_numba.scaled_dot_product_attention_backward(
        dev(g), dev(q), dev(kp), dev(vp), out, lse, **kw))
    rq = reference.attention_backward(g, q, k, v, **kw)[0]
    assert rel_err(dq, rq) < 1e-10
    assert (dk[:, :, unseen] == 0).all() and (dv[:, :, unseen] == 0).all()


def test_varlen_forward_backward(rng):
    lq, lk = [3, 0, 9, 2], [5, 2, 11, 0]
    kw = dict(chunk=4, is_causal=True, alignment="bottom_right")
    q, k, v = packed(rng, lq, lk, 4, 2, 5, 3)
    cq, ck = cu(lq), cu(lk)
    out = dev(np.full((sum(lq), 4, 3), np.nan))
    res, lse = varlen_attention(dev(q), dev(k), dev(v), cq, ck, out=out, return_lse=True, **kw)
    res, lse = res.copy_to_host(), lse.copy_to_host()
    ref, ref_lse = reference_forward(q, k, v, cq, ck, **kw)
    assert rel_err(res, ref) < 1e-12
    fin = np.isfinite(ref_lse)
    assert (np.isfinite(lse) == fin).all()
    g = rng.standard_normal(res.shape)
    grads = varlen_attention_backward(dev(g), dev(q), dev(k), dev(v), dev(res), dev(lse),
                                      cq, ck, **kw)
    for x, y in zip(grads, reference_grads(g, q, k, v, cq, ck, **kw)[:3]):
        assert rel_err(_host(x), y) < 1e-10


def test_decode_reads_only_its_chunk(rng):
    # One new token at position 20 of a cache of 21 keys, chunks of 8: keys 0..15 are NaN.
    n, c = 21, 8
    q = rng.standard_normal((1, 1, 2, 4))
    kc = rng.standard_normal((1, n, 2, 4))
    vc = rng.standard_normal((1, n, 2, 3))
    kp, vp = kc.copy(), vc.copy()
    kp[:, :n // c * c] = np.nan
    vp[:, :n // c * c] = np.nan
    out = sdpa_numba.attention_with_kvcache(dev(q), dev(kp), dev(vp), np.array([n]), chunk=c)
    ro, _ = reference.attention(q[0].transpose(1, 0, 2), kc[0].transpose(1, 0, 2),
                                vc[0].transpose(1, 0, 2), is_causal=True,
                                alignment="bottom_right", chunk=c)
    assert rel_err(out.copy_to_host()[0], ro.transpose(1, 0, 2)) < 1e-12
