"""varlen_attention and its backward on CUDA arrays (the dense CUDA kernels on per-sequence
views), under the simulator, against the per-sequence float64 reference (no CPU kernel runs
here: nothing to compile for the CPU)."""

import numpy as np

from sdpa_cuda_testing import dev, rel_err
from sdpa_numba import reference, varlen_attention, varlen_attention_backward
from varlen_checks import (bias_mod, bias_mod_grad, cu, keep_mod, packed, per_sequence,
                           reference_forward, reference_grads)

LQ = [3, 0, 1, 6, 2, 0]
LK = [5, 2, 0, 6, 3, 0]




def _check(rng, ref_forward, **kw):
    q, k, v = packed(rng, LQ, LK, 4, 2, 5, 3)
    g = rng.standard_normal((sum(LQ), 4, 3))
    cq, ck = cu(LQ), cu(LK)
    out = dev(np.full(g.shape, np.nan))
    res, lse = varlen_attention(dev(q), dev(k), dev(v), cq, dev(ck), out=out, return_lse=True,
                                **kw)
    assert res is out
    res, lse = res.copy_to_host(), lse.copy_to_host()
    ref, ref_lse = ref_forward(q, k, v, cq, ck)
    assert rel_err(res, ref) < 1e-12
    assert np.array_equal(np.isfinite(lse), np.isfinite(ref_lse))
    finite = np.isfinite(ref_lse)
    np.testing.assert_allclose(lse[finite], ref_lse[finite], rtol=1e-12)

    grads = varlen_attention_backward(dev(g), dev(q), dev(k), dev(v), dev(res), dev(lse),
                                      cq, ck, **kw)
    want = reference_grads(g, q, k, v, cq, ck, **kw)
    assert len(grads) == (4 if "sinks" in kw else 3)
    for x, y in zip(grads, want):
        x = x if isinstance(x, np.ndarray) else x.copy_to_host()
        assert x.shape == np.shape(y) and rel_err(x, y) < 1e-10


def test_gqa_causal_bottom_right_dropout_and_empty_sequences(rng):
    kw = dict(is_causal=True, alignment="bottom_right", dropout_p=0.25, seed=7)
    _check(rng, lambda *a: per_sequence(reference.attention_dropout, *a, enable_gqa=True,
                                        **kw), **kw)


def test_every_variant_per_sequence(rng):
    n = len(LQ)
    kw = dict(alibi_slopes=rng.random((n, 4)) * 0.3, sinks=np.array([0.5, -np.inf, -1.0, 2.0]),
              score_mod=bias_mod, mask_mod=keep_mod, window=(4, 1),
              mod_args=(rng.standard_normal((n, 4)), np.array([3, 4, 5, 2, 7, 3], np.int64)))
    _check(rng, lambda *a: reference_forward(*a, **kw), score_mod_grad=bias_mod_grad, **kw)
