"""Shared checks of attention_with_kvcache (the CPU and the CUDA suites): per-sequence float64
references of decode against a contiguous or paged cache, with the variants and left padding."""

import numpy as np

from checks import TOL, rel_err
from sdpa_numba.reference import attention


def _shifted(f, kind, b, shift):
    """``f`` (a user's score_mod, ``kind`` "score", or mask_mod, "mask") as the reference of
    one sequence calls it: there its batch index is 0 and its rows are the tokens; the kernels
    call it with the sequence ``b`` and the positions in the cache, ``t + shift``."""
    if f is None:
        return None
    f = getattr(f, "py_func", f)
    if kind == "score":
        return lambda s, _, h, i, j, *a: f(s, b, h, i + shift, j, *a)
    return lambda _, h, i, j, *a: f(b, h, i + shift, j, *a)


def ref_sequence(q, k, v, causal, scale=None, b=0, leftpad=0, alibi_slopes=None,
                 score_mod=None, mask_mod=None, mod_args=(), **variants):
    """Reference of sequence ``b``: q (Lq, Hq, E) against k (n, H, E), v (n, H, Ev), bottom-right
    aligned, keys before ``leftpad`` masked out, the variants as the kernels see them."""
    lq, n = q.shape[0], k.shape[0]
    mask = np.broadcast_to(np.arange(n)[None, :] >= leftpad, (lq, n))
    if alibi_slopes is not None:
        alibi_slopes = np.asarray(alibi_slopes)
        alibi_slopes = alibi_slopes[b] if alibi_slopes.ndim == 2 else alibi_slopes
    o, lse = attention(q.transpose(1, 0, 2), k.transpose(1, 0, 2), v.transpose(1, 0, 2),
                       attn_mask=mask, is_causal=causal, alignment="bottom_right", scale=scale,
                       enable_gqa=True, alibi_slopes=alibi_slopes,
                       score_mod=_shifted(score_mod, "score", b, n - lq),
                       mask_mod=_shifted(mask_mod, "mask", b, n - lq), mod_args=mod_args, **variants)
    return o.transpose(1, 0, 2), lse


def logical(cache, table, b, n):
    """The first ``n`` key rows of sequence ``b`` of a paged cache, in key order."""
    ps = cache.shape[1]
    j = np.arange(n)
    return cache[table[b, j // ps], j % ps]


def check_against_reference(q, kc, vc, seqlens, out, lse, causal, table=None, tol=None,
                            scale=None, leftpad=None, **variants):
    tol = TOL[q.dtype.type] if tol is None else tol
    for b in range(q.shape[0]):
        n = seqlens[b]
        k = kc[b, :n] if table is None else logical(kc, table, b, n)
        v = vc[b, :n] if table is None else logical(vc, table, b, n)
        ro, rl = ref_sequence(q[b], k, v, causal, scale, b,
                              0 if leftpad is None else leftpad[b], **variants)
        assert rel_err(out[b], ro) < tol, b
        finite = np.isfinite(rl)
        np.testing.assert_array_equal(lse[b][~finite], rl[~finite])
        np.testing.assert_allclose(lse[b][finite], rl[finite],
                                   rtol=1e-12 if q.dtype == np.float64 else 1e-5)
