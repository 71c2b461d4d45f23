"""``cascade_attention``: a batch of requests that share a prefix (a system prompt), each with
its own suffix in a key/value cache, attended as two levels merged by log-sum-exp (FlashInfer's
``MultiLevelCascadeAttentionWrapper`` with two levels).

* **The shared level.** The prefix's keys and values are one contiguous copy, ``(P, H, E)``,
  read once per batch instead of once per request: every query row of the batch that reads key
  / value head ``h`` (``B * Lq * Hq / H`` rows with GQA) is one row of a single non-causal
  block against the prefix's head ``h``, computed by the dense forward
  (:func:`sdpa_numba.scaled_dot_product_attention`).
* **The unique level.** Each request's suffix is an ordinary cache, contiguous or paged, with
  ``cache_seqlens`` and an optional append, attended by
  :func:`sdpa_numba.attention_with_kvcache` (causal, bottom-right, in the suffix's frame).
* **The merge.** The two partial results are combined by their lse
  (:func:`sdpa_numba.merge_attention_states`).

Everything is validated before anything is written (the suffix through its plan,
:func:`sdpa_numba.kvcache_plan`; the prefix by :func:`sdpa_numba.problem.cascade.check_prefix`):
a refused call appends nothing and leaves ``out`` untouched.
"""

from typing import Any

import numpy as np

from .api import scaled_dot_product_attention
from .host_arrays import as_numpy
from .kvcache import kvcache_plan
from .merge import merge_attention_states
from .problem.arguments import check_flag
from .problem.cascade import check_prefix, fold_queries, unfold_rows
from .problem.out import check_out
from .targets import CUDA, HOST, target_of

__all__ = ["cascade_attention"]


def cascade_attention(q: Any, prefix_k: Any, prefix_v: Any, k_cache: Any, v_cache: Any,
                      cache_seqlens: Any, *, k: Any = None, v: Any = None,
                      block_table: Any = None, is_causal: bool = True,
                      scale: float | None = None, return_lse: bool = False,
                      out: Any = None) -> Any:
    """Attention of new query tokens against a prefix shared by every request of the batch,
    then each request's own cache (shared-prefix, or cascade, attention).

    Request ``b`` attends the concatenation of the prefix (``P`` keys) and its suffix (the
    first ``cache_seqlens[b]`` keys of its cache, then the appended ``k``, ``v``): the result
    equals attention over that concatenated cache, with every prefix key visible to every
    query token and the suffix causal as in :func:`attention_with_kvcache`.

    Parameters
    ----------
    q : ndarray, shape (B, Lq, Hq, E)
        The new query tokens of each request: float16, bfloat16, float32 or float64.
    prefix_k : ndarray, shape (P, H, E)
        The shared prefix's keys, one copy for the whole batch; q's dtype, any strides.
        ``P`` may be 0.
    prefix_v : ndarray, shape (P, H, Ev)
    k_cache, v_cache : ndarrays, shapes (B, S_max, H, E / Ev) or (num_pages, page_size, H,
        E / Ev)
        Each request's own keys after the prefix (the suffix), contiguous or, with
        ``block_table``, paged: as for :func:`attention_with_kvcache`.
    cache_seqlens : int or array of ints, shape (B,)
        Suffix keys already in each request's cache (0: no suffix yet).
    k, v : ndarrays, shapes (B, Lq_new, H, E) and (B, Lq_new, H, Ev), keyword-only, optional
        New keys and values appended to each suffix first (the one in-place update), as for
        :func:`attention_with_kvcache`.
    block_table : ndarray of int32, shape (B, max_pages), keyword-only, optional
        The suffixes' pages (paged cache).
    is_causal : bool, keyword-only
        Causal in the suffix (default True): with ``n = cache_seqlens[b] + Lq_new`` suffix
        keys, query token ``t`` sees suffix keys ``j <= n - Lq + t``, and the whole prefix.
        False: every key.
    scale : float, keyword-only, optional
        Multiplies ``q · k``; default ``1 / sqrt(E)``.
    return_lse : bool, keyword-only
        Also return the log-sum-exp over prefix and suffix, shape (B, Hq, Lq), in the compute
        dtype.
    out : ndarray, shape (B, Lq, Hq, Ev), keyword-only, optional
        A buffer of q's dtype, written in place and returned.

    Returns
    -------
    out : ndarray of q's dtype, shape (B, Lq, Hq, Ev)
    lse : ndarray, shape (B, Hq, Lq), only with ``return_lse=True``

    Raises
    ------
    TypeError, ValueError
        For bad input, naming the argument, before anything is read or written.
    NotImplementedError
        For CUDA arrays (the shared level's folding of the queries is host code).

    Notes
    -----
    The prefix is read by the dense forward's tasks (one per key/value head and chunk of up
    to 512 query rows), not by each request: with ``R = B * Lq * Hq / H`` rows per head, it
    is read about ``max(R / 512, 16 / H)`` times per call (the forward splits the rows until
    it has 16 tasks, down to chunks of 16 rows), against ``B`` times by per-request calls. The two levels' outputs are each
    rounded to q's dtype before the merge: float32 and float64 lose nothing to it, float16
    and bfloat16 up to about one unit in the last place more than one kernel over the whole
    cache. Where ``n < Lq`` (no append, fewer suffix keys than query tokens), a causal token
    still sees the whole prefix: over a concatenated cache it would see only the prefix keys
    up to its own position.
    """
    named = [("q", q), ("prefix_k", prefix_k), ("prefix_v", prefix_v), ("k_cache", k_cache),
             ("v_cache", v_cache), ("k", k), ("v", v), ("out", out)]
    target = target_of(named, required=("q", "prefix_k", "prefix_v", "k_cache", "v_cache"))
    if target is CUDA:
        raise NotImplementedError(
            "cascade_attention runs on the CPU only: its shared level folds the batch's "
            "queries into one block of rows with host code; for CUDA arrays, call "
            "attention_with_kvcache over each request's concatenated cache")
    return_lse = check_flag("return_lse", return_lse)
    appending = k is not None
    k_cache = as_numpy("k_cache", k_cache, writable=appending)
    v_cache = as_numpy("v_cache", v_cache, writable=appending)
    (q, prefix_k, prefix_v, k, v, out), restore = _adopt_rest(q, prefix_k, prefix_v, k, v, out)
    plan = kvcache_plan(q, k_cache, v_cache, cache_seqlens, k=k, v=v, block_table=block_table,
                        is_causal=is_causal, scale=scale)
    p = plan.problem
    check_prefix(p, prefix_k, prefix_v)
    if out is not None:
        check_out(p, out, (("q", q), ("prefix_k", prefix_k), ("prefix_v", prefix_v),
                           ("k_cache", k_cache), ("v_cache", v_cache), ("k", k), ("v", v)),
                  HOST.address)
    b, lq, hq, _ = p.q_shape
    h = p.k_cache_shape[2]
    # The shared level: one block of rows per key/value head against the prefix.
    rows = fold_queries(q, h)
    pre_out, pre_lse = scaled_dot_product_attention(
        rows, prefix_k.transpose(1, 0, 2)[None], prefix_v.transpose(1, 0, 2)[None],
        scale=p.scale, return_lse=True)
    pre_out = unfold_rows(pre_out, (b, lq, hq))
    pre_lse = unfold_rows(pre_lse, (b, lq, hq))
    # The unique level (the append happens here), then the merge, both as (B, Lq, Hq, ..).
    suf_out, suf_lse = plan.run(q, k_cache, v_cache, k=k, v=v, return_lse=True)
    merged, lse = merge_attention_states(pre_out, pre_lse, suf_out,
                                         suf_lse.transpose(0, 2, 1))
    if out is not None:
        out[...] = merged
        merged = out
    merged = restore(merged)
    return (merged, restore(np.ascontiguousarray(lse.transpose(0, 2, 1)))) if return_lse \
        else merged


def _adopt_rest(q, prefix_k, prefix_v, k, v, out):
    """The operands other than the caches as NumPy arrays (no copies), and ``restore``."""
    arrays, restore = HOST.adopt([("q", q), ("prefix_k", prefix_k), ("prefix_v", prefix_v),
                                  ("k", k), ("v", v)], out)
    if out is None:
        arrays = [*arrays, None]
    return arrays, restore
