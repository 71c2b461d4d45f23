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

The same steps run for host and CUDA arrays: the target (:mod:`sdpa_numba.targets`) only
picks how the queries are folded into rows and the rows unfolded (copies of strided views:
NumPy's, or the kernels of :mod:`sdpa_numba.gpu.gather`).
"""

from typing import Any

from .api import scaled_dot_product_attention
from .host_arrays import as_numpy
from .kvcache import kvcache_plan
from .merge import merge_attention_states
from .problem.arguments import check_flag
from .problem.cascade import check_prefix, fold_view, swap_last_view, unfold_view
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

    Notes
    -----
    Host arrays run on the CPU kernels, CUDA arrays (Numba, CuPy, PyTorch; all on one device)
    on the CUDA kernels, with the same steps: the queries are folded into rows (and the
    results back) by copies, NumPy's on the host and small bit-copy kernels on the device
    (:mod:`sdpa_numba.gpu.gather`); the results come back as q's kind of array.

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
    return_lse = check_flag("return_lse", return_lse)
    (q, prefix_k, prefix_v, k_cache, v_cache, k, v, out), restore = _adopt(target, named)
    plan = kvcache_plan(q, k_cache, v_cache, cache_seqlens, k=k, v=v, block_table=block_table,
                        is_causal=is_causal, scale=scale)
    p = plan.problem
    check_prefix(p, prefix_k, prefix_v)
    if out is not None:
        check_out(p, out, (("q", q), ("prefix_k", prefix_k), ("prefix_v", prefix_v),
                           ("k_cache", k_cache), ("v_cache", v_cache), ("k", k), ("v", v)),
                  target.address)
    # Validated: from here on, only writes. The target copies (NumPy, or the bit-copy kernels
    # of sdpa_numba.gpu.gather); the views are the same for both.
    packed = target.packed
    view = target.as_strided
    b, lq, hq, _ = p.q_shape
    h = p.k_cache_shape[2]
    r = b * lq * (hq // h)
    # The shared level: one block of rows per key/value head against the prefix.
    rows = packed(fold_view(q, h, view), (1, h, r, q.shape[3]))
    pre_out, pre_lse = scaled_dot_product_attention(
        rows, _heads_first(prefix_k, view), _heads_first(prefix_v, view), scale=p.scale,
        return_lse=True)
    pre_out = packed(unfold_view(pre_out, (b, lq, hq), view), (b, lq, hq, pre_out.shape[3]))
    pre_lse = packed(unfold_view(pre_lse, (b, lq, hq), view), (b, lq, hq))
    # The unique level (the append happens here), then the merge, both as (B, Lq, Hq, ..),
    # contiguous (the CUDA merge takes its rows in one launch then).
    suf_out, suf_lse = plan.run(q, k_cache, v_cache, k=k, v=v, return_lse=True)
    suf_lse = packed(swap_last_view(suf_lse, view), (b, lq, hq))
    merged, lse = merge_attention_states(pre_out, pre_lse, suf_out, suf_lse)
    if out is not None:
        target.copy_into(out, merged)
        merged = out
    merged = restore(merged)
    return (merged, restore(packed(swap_last_view(lse, view), (b, hq, lq)))) if return_lse \
        else merged


def _adopt(target, named):
    """The operands (``named``'s order, ``out`` last) as the target's arrays, without copies
    (the caches are written by an append, ``out`` by the result), and ``restore``."""
    *named, (_, out) = named
    if target is CUDA:
        arrays, restore = CUDA.adopt(named, out)
        CUDA.check_strides(list(zip((n for n, _ in named), arrays)))
    else:
        appending = named[5][1] is not None
        caches = [as_numpy(n, x, writable=appending) for n, x in named[3:5]]
        arrays, restore = HOST.adopt([*named[:3], *named[5:]], out)
        arrays = [*arrays[:3], *caches, *arrays[3:]]
    if out is None:
        arrays = [*arrays, None]
    return arrays, restore


def _heads_first(x, view):
    """The prefix ``x (P, H, E)`` as the dense forward's ``(1, H, P, E)`` (a view)."""
    (n, h, e), (sn, sh, se) = tuple(x.shape), tuple(x.strides)
    return view(x, (1, h, n, e), (0, sh, sn, se))
