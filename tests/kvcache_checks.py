"""Shared checks of attention_with_kvcache (the CPU and the CUDA suites): per-sequence float64
references of decode against a contiguous or paged cache, with the variants and left padding."""

import numba
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
                       mask_mod=_shifted(mask_mod, "mask", b, n - lq), mod_args=mod_args,
                       **variants)
    return o.transpose(1, 0, 2), lse


def logical(cache, table, b, n):
    """The first ``n`` key rows of sequence ``b`` of a paged cache, in key order."""
    ps = cache.shape[1]
    j = np.arange(n)
    return cache[table[b, j // ps], j % ps]


def at_thread_counts(call):
    """``call()`` at 1 thread and, where Numba has them, at 2: the results in that order
    (the thread count restored after)."""
    n = numba.get_num_threads()
    results = []
    try:
        for threads in sorted({1, min(2, numba.config.NUMBA_NUM_THREADS)}):
            numba.set_num_threads(threads)
            results.append(call())
    finally:
        numba.set_num_threads(n)
    return results


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


def paged_copy(rng, cache, page_size, extra_pages=3):
    """A paged copy of a contiguous cache (B, S_max, ...): shuffled pages, unused pages of
    garbage (NaN), and its block table."""
    B, S = cache.shape[:2]
    per = -(-S // page_size)
    n_pages = B * per + extra_pages
    paged = np.full((n_pages, page_size, *cache.shape[2:]), np.nan, cache.dtype)
    order = rng.permutation(n_pages)[:B * per].reshape(B, per).astype(np.int32)
    for b in range(B):
        for p in range(per):
            rows = cache[b, p * page_size:(p + 1) * page_size]
            paged[order[b, p], :len(rows)] = rows
    return paged, order


def paged_pair(rng, kc, vc, page_size):
    """Paged copies of both caches with one shuffled block table."""
    if page_size is None:
        return kc, vc, None
    pk, table = paged_copy(rng, kc, page_size)
    pv = np.full((pk.shape[0], page_size, *vc.shape[2:]), np.nan, vc.dtype)
    for b in range(kc.shape[0]):
        for p in range(table.shape[1]):
            rows = vc[b, p * page_size:(p + 1) * page_size]
            pv[table[b, p], :len(rows)] = rows
    return pk, pv, table


@numba.njit
def _score_mod(s, b, h, i, j, bias):
    # depends on every index: the batch, the query head, the position and the key
    return s + bias[b, h] * 0.01 * (i - j) + 0.1 * ((i + 2 * j) % 3)


@numba.njit
def _mask_mod(b, h, i, j, bias):
    return (i + j + h + b) % 5 != 0


def _alibi(rng, B, Hq):
    return np.abs(rng.standard_normal((B, Hq))) * 0.2


#: Each variant's keywords for a batch of B sequences and Hq query heads (windows short enough
#: to cut the small problems of the CUDA tests too).
VARIANTS = {
    "window": lambda rng, B, Hq: {"window": (5, 0)},
    "window_not_causal": lambda rng, B, Hq: {"window": (4, 2), "is_causal": False},
    "softcap": lambda rng, B, Hq: {"softcap": 1.5, "window": (None, 0)},
    "chunk": lambda rng, B, Hq: {"chunk": 5},
    "alibi_sinks": lambda rng, B, Hq: {"alibi_slopes": _alibi(rng, B, Hq),
                                       "sinks": np.r_[rng.standard_normal(Hq - 1) + 2,
                                                      -np.inf]},
    "mods": lambda rng, B, Hq: {"score_mod": _score_mod, "mask_mod": _mask_mod,
                                "mod_args": (rng.standard_normal((B, Hq)),)},
}
