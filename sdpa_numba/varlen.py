"""``varlen_attention`` and its backward: attention over a ragged batch packed back to back
(FlashAttention's ``flash_attn_varlen_func`` layouts), for prefill and training on packed
sequences without padding.

Validation (:mod:`sdpa_numba.problem.varlen`) happens here, before any jitted code runs; the
kernels are :func:`sdpa_numba.cpu.varlen.varlen_forward` and ``varlen_backward``.
"""

from typing import TYPE_CHECKING, Any, Literal, overload

from ._typing import ArrayT
from .backward import _check_like
from .dropout import new_seed
from .dropout import params as dropout_params
from .problem import check_dropout, check_flag, check_out, check_seed
from .problem.variant_table import check_names, takes_variants, variant_grads
from .problem.varlen import varlen_plan
from .targets import CUDA, target_of

if TYPE_CHECKING:
    from typing_extensions import Unpack

    from ._typing import ForwardVariants, Variants

__all__ = ["varlen_attention", "varlen_attention_backward"]


@overload
def varlen_attention(q: ArrayT, k: ArrayT, v: ArrayT, cu_seqlens_q: Any,
                     cu_seqlens_k: Any = ..., *,
                     max_seqlen_q: int | None = ..., max_seqlen_k: int | None = ...,
                     is_causal: bool = ..., scale: float | None = ..., dropout_p: float = ...,
                     seed: int | None = ..., return_lse: Literal[False] = ...,
                     out: ArrayT | None = ..., block_table: Any = ...,
                     seqused_k: Any = ...,
                     **variants: "Unpack[ForwardVariants]") -> ArrayT: ...


@overload
def varlen_attention(q: ArrayT, k: ArrayT, v: ArrayT, cu_seqlens_q: Any,
                     cu_seqlens_k: Any = ..., *,
                     max_seqlen_q: int | None = ..., max_seqlen_k: int | None = ...,
                     is_causal: bool = ..., scale: float | None = ..., dropout_p: float = ...,
                     seed: int | None = ..., return_lse: Literal[True],
                     out: ArrayT | None = ..., block_table: Any = ...,
                     seqused_k: Any = ...,
                     **variants: "Unpack[ForwardVariants]") -> tuple[ArrayT, Any]: ...


@overload
def varlen_attention(q: ArrayT, k: ArrayT, v: ArrayT, cu_seqlens_q: Any,
                     cu_seqlens_k: Any = ..., *,
                     max_seqlen_q: int | None = ..., max_seqlen_k: int | None = ...,
                     is_causal: bool = ..., scale: float | None = ..., dropout_p: float = ...,
                     seed: int | None = ..., return_lse: bool, out: ArrayT | None = ...,
                     block_table: Any = ..., seqused_k: Any = ...,
                     **variants: "Unpack[ForwardVariants]") -> ArrayT | tuple[ArrayT, Any]: ...


@takes_variants()
def varlen_attention(q: Any, k: Any, v: Any, cu_seqlens_q: Any, cu_seqlens_k: Any = None, *,
                     max_seqlen_q: int | None = None, max_seqlen_k: int | None = None,
                     is_causal: bool = False, scale: float | None = None,
                     dropout_p: float = 0.0, seed: int | None = None,
                     return_lse: bool = False, out: Any = None, block_table: Any = None,
                     seqused_k: Any = None, **variants: Any) -> Any:
    """Attention over a ragged batch of sequences packed back to back.

    Sequence ``b`` is query rows ``cu_seqlens_q[b] .. cu_seqlens_q[b + 1]`` of ``q`` and keys
    ``cu_seqlens_k[b] .. cu_seqlens_k[b + 1]`` of ``k`` and ``v``; it attends to its own keys
    only, exactly as :func:`~sdpa_numba.scaled_dot_product_attention` on that sequence alone.

    Parameters
    ----------
    q : ndarray or CUDA array, shape (total_q, Hq, E)
        float16, bfloat16, float32 or float64; any strides. NumPy (host) arrays run on the
        CPU kernels, CUDA arrays on the CUDA kernels (q, k, v and out on one side; the result
        comes back as q's kind of array).
    k : ndarray or CUDA array, shape (total_k, H, E)
        ``Hq`` a multiple of ``H``: query head ``h`` uses key/value head ``h // (Hq // H)``
        (grouped-query attention when ``H < Hq``).
    v : ndarray or CUDA array, shape (total_k, H, Ev)
    cu_seqlens_q, cu_seqlens_k : array of int32 or int64, shape (B + 1,)
        Cumulative sequence lengths: start at 0, never decrease, end at ``total_q`` and
        ``total_k``. Read on the host (a CUDA array is copied). Sequences of length 0 are allowed (a query row of a sequence without
        keys gets zeros and ``lse = -inf``). ``cu_seqlens_k`` is required but with
        ``block_table``; with it, it may be given and gives lengths only (FlashAttention
        2's paged varlen): its last entry is free, and ``seqused_k`` defaults to its
        lengths and may not exceed them.
    max_seqlen_q, max_seqlen_k : int, optional
        FlashAttention's hints: not needed here; if given, checked to be at least the longest
        sequence.
    is_causal : bool
        Query ``i`` of a sequence sees its keys ``j <= i'`` (``i'`` per ``alignment``).
    scale : float, optional
        Multiplies ``Q Kᵀ``; default ``1 / sqrt(E)``.
    dropout_p : float
        Drop probability, as for the dense function. The mask of sequence ``b`` is the
        dense function's stream of ``(seed, b, head, row, key)``: the mask that
        :func:`~sdpa_numba.scaled_dot_product_attention` draws for batch entry ``b`` of a
        batched call with the same seed (rows and keys counted within the sequence).
    seed : int, optional
        The dropout seed (None: a fresh one; pass one for the backward).
    return_lse : bool
        Also return the log-sum-exp of each row, shape ``(Hq, total_q)`` (FlashAttention's
        varlen layout), in the compute dtype.
    out : ndarray, optional
        Buffer of shape ``(total_q, Hq, Ev)`` and the inputs' dtype, written and returned.
    block_table : array of ints, shape (B, max_pages), keyword-only, optional
        Keys through a paged cache (FlashAttention's ``block_table``; vLLM's and SGLang's
        mixed prefill + decode batches): ``k`` and ``v`` are then caches ``(num_pages,
        page_size, H, E)`` and ``(num_pages, page_size, H, Ev)`` (any ``page_size >= 1``,
        last dim contiguous), and key ``j`` of sequence ``b`` is slot ``j % page_size`` of
        page ``block_table[b, j // page_size]``, for its first ``seqused_k[b]`` keys (the
        entries of the pages in use in ``[0, num_pages)``; the rest are not read). Read on
        the host. Everything else (alignment, variants, ``lse``) as without it: the result
        is that of the keys gathered into a packed ``k``. Runs the decode kernel
        (:func:`sdpa_numba.attention_with_kvcache`'s, one launch; with
        ``alignment="bottom_right"`` and no ``score_mod`` / ``mask_mod`` bit for bit its
        result with ``cu_seqlens_q`` and ``cache_seqlens=seqused_k``). Its gradients:
        :func:`varlen_attention_backward` with the same ``block_table`` / ``seqused_k``
        (host or CUDA arrays). No dropout (NotImplementedError). CUDA arrays run the decode
        kernel's CUDA twin (tested on Numba's CUDA simulator, not yet timed on a GPU).
    seqused_k : array of ints, shape (B,), keyword-only, optional
        The keys of each sequence (FlashAttention's ``seqused_k``): with ``block_table``,
        the first ``seqused_k[b]`` tokens through its pages (at most ``max_pages *
        page_size``); without it, the first ``seqused_k[b]`` of the sequence's range of ``k``
        in ``cu_seqlens_k`` (at most its length; ``k``, ``v`` read in place as pages, no
        copy), with the same kernel, limits and guarantees as ``block_table``. ``>= 0``;
        read on the host.

    Other Parameters
    ----------------
    window, chunk, alignment, softcap, alibi_slopes, sinks, score_mod, mask_mod, mod_args : as in the dense function
        The variants of the dense function, applied per sequence: rows ``i`` and keys ``j``
        count from the sequence's first (so do the chunks: each sequence's first key starts
        a chunk), ``alignment="bottom_right"`` aligns each sequence's
        last query with its last key, ``alibi_slopes`` has shape ``(Hq,)`` or ``(B, Hq)``, and
        ``score_mod(score, b, h, i, j, *mod_args)`` / ``mask_mod(b, h, i, j, *mod_args)`` get
        the sequence index as ``b``.
    score_mod_grad : Numba @njit function, optional
        Checked, then ignored (the backward's).
    block_mask : None
        Refused (ValueError): a BlockMask is one grid of blocks over a single (L, S) shape,
        which the sequences of a ragged batch do not share; pass its ``mask_mod``.

    Returns
    -------
    out : ndarray, shape (total_q, Hq, Ev)
    lse : ndarray, shape (Hq, total_q), only with ``return_lse=True``

    Raises
    ------
    TypeError, ValueError
        For bad input (cu_seqlens of a float dtype, not starting at 0, decreasing, not ending
        at the totals, of different lengths for q and k; shapes, dtypes, variants;
        ``seqused_k`` negative, beyond the pages or the sequence, ``block_table`` entries
        out of range), naming the argument, before any kernel runs.
    NotImplementedError
        With ``block_table`` or ``seqused_k``: dropout.

    Notes
    -----
    NumPy (host) arrays run on the CPU: one parallel launch covers the whole batch (tasks of
    sequence x head x query rows, costliest first); results are bitwise the same for any
    thread count. CUDA arrays (q, k, v, out all on the device; the cu_seqlens are read on
    the host) run the dense CUDA kernel in one launch over the whole batch (a work list of
    (sequence, block of rows), :mod:`sdpa_numba.gpu.work`).
    """
    named = [("q", q), ("k", k), ("v", v), ("out", out)]
    target = target_of(named, ("q", "k", "v"))
    if block_table is not None or seqused_k is not None:
        return _over_cache(target, q, k, v, out, cu_seqlens_q, cu_seqlens_k, block_table,
                           seqused_k, max_seqlen_q, max_seqlen_k, is_causal, scale,
                           dropout_p, return_lse, variants)
    arrays, restore = target.adopt(named[:3], out)
    q, k, v = arrays[:3]
    out = arrays[3] if out is not None else None
    check_names("varlen_attention", variants, target=target)
    p = varlen_plan(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q=max_seqlen_q,
                    max_seqlen_k=max_seqlen_k, is_causal=is_causal, scale=scale, **variants)
    dropout_p = check_dropout(dropout_p)
    seed = check_seed(seed)
    return_lse = check_flag("return_lse", return_lse)
    target.check_strides([("q", q), ("k", k), ("v", v), ("out", out)])
    if out is not None:
        check_out(p, out, [("q", q), ("k", k), ("v", v)], target.address)
    dropout = None
    if dropout_p > 0:
        dropout = dropout_params(dropout_p, new_seed() if seed is None else seed)
    result, lse = target.varlen_forward(p, q, k, v, out, dropout)
    result, lse = restore(result), restore(lse)
    return (result, lse) if return_lse else result


def _over_cache(target, q, k, v, out, cu_seqlens_q, cu_seqlens_k, block_table, seqused_k,
                max_seqlen_q, max_seqlen_k, is_causal, scale, dropout_p, return_lse, variants):
    """:func:`varlen_attention` with ``block_table`` / ``seqused_k``: the keys read where they
    are, by the decode kernel (one launch; the ragged batch's rows placed by its table, see
    :func:`sdpa_numba.problem.kvcache.ragged_table`), in the sequences' own frame."""
    from .problem.kvcache import cache_varlen_problem
    from .targets import CUDA

    arrays, restore = target.adopt([("q", q), ("k", k), ("v", v)], out)
    q, k, v = arrays[:3]
    out = arrays[3] if out is not None else None
    check_names("varlen_attention", variants, target=target)
    strided = None
    if target is CUDA:
        from .gpu.arrays import as_strided as strided
    target.check_strides([("q", q), ("k", k), ("v", v), ("out", out)])
    k_cache, v_cache, p = cache_varlen_problem(
        q, k, v, cu_seqlens_q, cu_seqlens_k, block_table, seqused_k, max_seqlen_q=max_seqlen_q,
        max_seqlen_k=max_seqlen_k, is_causal=is_causal, scale=scale, as_strided=strided,
        **variants)
    if check_dropout(dropout_p) > 0:
        raise NotImplementedError("dropout_p > 0 with block_table / seqused_k is not built "
                                  "(the decode kernel draws no dropout mask)")
    return_lse = check_flag("return_lse", return_lse)
    if out is not None:
        check_out(p, out, [("q", q), ("k", k), ("v", v)], target.address)
    result, lse = target.prepare_decode(p)(q, k_cache, v_cache, None, None, out)
    result, lse = restore(result), restore(lse)
    return (result, lse) if return_lse else result


@overload
def varlen_attention_backward(grad_out: ArrayT, q: ArrayT, k: ArrayT, v: ArrayT, out: ArrayT,
                              lse: Any, cu_seqlens_q: Any, cu_seqlens_k: Any, *,
                              max_seqlen_q: int | None = ..., max_seqlen_k: int | None = ...,
                              is_causal: bool = ..., scale: float | None = ...,
                              dropout_p: float = ..., seed: int | None = ..., sinks: None = ...,
                              block_table: None = ..., seqused_k: None = ...,
                              **variants: "Unpack[Variants]") -> tuple[ArrayT, ArrayT, ArrayT]:
    ...


@overload
def varlen_attention_backward(
        grad_out: ArrayT, q: ArrayT, k: ArrayT, v: ArrayT, out: ArrayT, lse: Any,
        cu_seqlens_q: Any, cu_seqlens_k: Any, *, sinks: Any = ...,
        max_seqlen_q: int | None = ..., max_seqlen_k: int | None = ..., is_causal: bool = ...,
        scale: float | None = ..., dropout_p: float = ..., seed: int | None = ...,
        block_table: None = ..., seqused_k: None = ...,
        **variants: "Unpack[Variants]") -> tuple[Any, ...]: ...


@takes_variants()
def varlen_attention_backward(grad_out: Any, q: Any, k: Any, v: Any, out: Any, lse: Any,
                              cu_seqlens_q: Any, cu_seqlens_k: Any, *,
                              max_seqlen_q: int | None = None,
                              max_seqlen_k: int | None = None, is_causal: bool = False,
                              scale: float | None = None, dropout_p: float = 0.0,
                              seed: int | None = None, block_table: Any = None,
                              seqused_k: Any = None, **variants: Any) -> tuple[Any, ...]:
    """Gradients of :func:`varlen_attention` (FlashAttention-2's backward, per sequence).

    Parameters
    ----------
    grad_out : ndarray or CUDA array, shape (total_q, Hq, Ev)
        Gradient of the loss with respect to the forward's output; the inputs' dtype. All
        arrays NumPy (CPU kernels) or all CUDA arrays (CUDA kernels).
    q, k, v, cu_seqlens_q, cu_seqlens_k
        As given to the forward (same checks); also every keyword below.
    out, lse : ndarray
        What the forward returned with ``return_lse=True``: ``out`` ``(total_q, Hq, Ev)``,
        ``lse`` ``(Hq, total_q)`` in the compute dtype.
    seed : int
        The forward's seed; required when ``dropout_p > 0``.

    block_table, seqused_k : array of ints, optional
        As given to the forward (keys through a paged cache, or the first ``seqused_k``
        keys of each sequence). ``grad_k`` and ``grad_v`` then have the shapes of ``k`` and
        ``v`` (the caches): each key's gradient at its slot, summed where sequences share a
        page, zero in slots no sequence reads. The keys are gathered into a packed copy
        (``sum(seqused_k)`` rows) for the packed backward and their gradients scattered
        back: memory for one packed copy of the used keys, values and their gradients. Host
        or CUDA arrays (on CUDA the gather and the scatter are small kernels, tested on
        Numba's CUDA simulator only); a slot read by several sequences gets their gradients
        summed in float64 in the sequences' order, then rounded to the dtype, on either
        target, so the result is deterministic. No dropout (NotImplementedError, as the forward).

    Other Parameters
    ----------------
    score_mod_grad : Numba @njit function
        ``d score_mod / d score``; required with a ``score_mod``.

    Returns
    -------
    grad_q, grad_k, grad_v : ndarray or CUDA array
        q's kind of array; the shapes and dtype of ``q``, ``k``, ``v`` (``grad_k``, ``grad_v`` summed over the
        query heads of each key/value head).
    grad_sinks : ndarray, only with ``sinks``
        Shape ``(Hq,)``, the sinks' dtype, last (as the dense backward's).

    Raises
    ------
    TypeError, ValueError
        For bad input, naming the argument, before any kernel runs.

    Notes
    -----
    Deterministic: bitwise the same for any thread count (no atomics; a sequence whose keys
    are split into groups sums its partial dQs in group order).
    """
    if block_table is not None or seqused_k is not None:
        return _backward_over_cache(grad_out, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k,
                                    block_table, seqused_k, max_seqlen_q, max_seqlen_k,
                                    is_causal, scale, dropout_p, seed, variants)
    named = [("q", q), ("grad_out", grad_out), ("k", k), ("v", v), ("out", out), ("lse", lse)]
    target = target_of(named, ("q", "grad_out", "k", "v", "out", "lse"))
    (q, grad_out, k, v, out, lse), restore = target.adopt(named)
    check_names("varlen_attention_backward", variants, target=target)
    p = varlen_plan(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q=max_seqlen_q,
                    max_seqlen_k=max_seqlen_k, is_causal=is_causal, scale=scale,
                    backward=True, **variants)
    dropout_p = check_dropout(dropout_p)
    seed = check_seed(seed)
    _check_like("grad_out", grad_out, p.out_shape, p.dtype, "the output")
    _check_like("out", out, p.out_shape, p.dtype, "the output")
    _check_like("lse", lse, p.lse_shape, p.compute_dtype,
                "the forward's log-sum-exp (compute dtype)")
    if dropout_p > 0 and seed is None:
        raise ValueError("dropout_p > 0 needs the seed the forward used: the backward "
                         "regenerates the dropout mask from it")
    target.check_strides(named)
    dropout = dropout_params(dropout_p, seed) if dropout_p > 0 and seed is not None else None
    grads = target.varlen_backward(p, grad_out, q, k, v, out, lse, dropout)
    grads = tuple(restore(g) for g in grads)
    host = target.to_host
    # the gradients read (..., Hq, L) rows: the packed rows as one batch entry
    return grads + variant_grads(p.recipe, variants,
                                 lambda: (host(grad_out).transpose(1, 0, 2),
                                          host(out).transpose(1, 0, 2), host(lse)))


def _backward_over_cache(grad_out, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, block_table,
                         seqused_k, max_seqlen_q, max_seqlen_k, is_causal, scale, dropout_p,
                         seed, variants):
    """:func:`varlen_attention_backward` with ``block_table`` / ``seqused_k``: the keys each
    sequence reads gathered into a packed copy, the packed backward run on it, and the keys'
    and values' gradients scattered back to the slots they came from (added where pages are
    shared). The packed backward sees the same rows, positions and lengths as the forward's
    ragged batch, so its gradients are those of the forward over the cache. The target picks
    the gather and the scatter (NumPy's indexing, or the kernels of
    :mod:`sdpa_numba.gpu.gather`); both sum a shared slot's gradients in float64, in packed
    order, then rounded to the dtype."""
    import numpy as np

    from .problem.kvcache import cache_rows, cache_varlen_problem

    named = [("q", q), ("grad_out", grad_out), ("k", k), ("v", v), ("out", out), ("lse", lse)]
    target = target_of(named, ("q", "grad_out", "k", "v", "out", "lse"))
    if check_dropout(dropout_p) > 0:
        raise NotImplementedError("dropout_p > 0 with block_table / seqused_k is not built "
                                  "(the forward draws no dropout mask over a cache)")
    (q, grad_out, k, v, out, lse), restore = target.adopt(named)
    check_names("varlen_attention_backward", variants, target=target)
    strided = None
    if target is CUDA:
        from .gpu.arrays import as_strided as strided

        target.check_strides(list(zip((n for n, _ in named), (q, grad_out, k, v, out, lse))))
    k_cache, v_cache, p = cache_varlen_problem(
        q, k, v, cu_seqlens_q, cu_seqlens_k, block_table, seqused_k, max_seqlen_q=max_seqlen_q,
        max_seqlen_k=max_seqlen_k, is_causal=is_causal, scale=scale, as_strided=strided,
        **variants)
    used = p.kv_lens
    rows = cache_rows(p.table, used, int(k_cache.shape[1]))
    cu_k = np.concatenate(([0], np.cumsum(used))).astype(np.int64)
    # The used slots packed, the packed backward, then each slot's gradient summed back (the
    # target moves: NumPy, or sdpa_numba.gpu.gather's kernels).
    grads = varlen_attention_backward(
        grad_out, q, target.gather_rows(k_cache, rows), target.gather_rows(v_cache, rows), out,
        lse, cu_seqlens_q, cu_k, max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k,
        is_causal=is_causal, scale=scale, seed=seed, **variants)
    return (restore(grads[0]),
            restore(target.scatter_sum_rows(grads[1], rows, k_cache, k.shape)),
            restore(target.scatter_sum_rows(grads[2], rows, v_cache, v.shape))) + tuple(grads[3:])

