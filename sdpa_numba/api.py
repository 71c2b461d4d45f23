"""The public function: validation, then dispatch through the operands' target
(:mod:`sdpa_numba.targets`: the CPU or the CUDA kernels).

Validation happens here, in the public layer, before any jitted code runs; the kernels trust
their arguments. The checks themselves are the target-neutral problem layer's
(:mod:`sdpa_numba.problem`: :func:`~sdpa_numba.problem.plan` on shapes and dtypes alone, the
argument and ``out`` checks); each back end then lays the operands out as strided views (never
copies) in the kernels' 4-D layout, with the same layer's views and batching.
"""

from typing import TYPE_CHECKING, Any, Literal, overload

import numpy.typing as npt

from ._typing import F16, F32, ArrayT, Mask, SelfComputed
from .dropout import new_seed
from .dropout import params as dropout_params
from .problem import (Plan, check_dropout, check_flag, check_out, check_seed, may_self_overlap,
                      plan)
from .problem.variant_table import check_names, takes_variants
from .targets import target_of

if TYPE_CHECKING:
    from typing_extensions import Unpack

    from ._typing import ForwardVariants

__all__ = ["scaled_dot_product_attention", "Plan", "plan", "check_dropout", "may_self_overlap"]


@overload
def scaled_dot_product_attention(  # type: ignore[overload-overlap]
        query: F16, key: F16, value: F16, attn_mask: Mask = ..., dropout_p: float = ...,
        is_causal: bool = ..., scale: float | None = ..., enable_gqa: bool = ..., *,
        return_lse: Literal[True], out: F16 | None = ..., seed: int | None = ...,
        **variants: "Unpack[ForwardVariants]"
) -> tuple[F16, F32]: ...


@overload
def scaled_dot_product_attention(  # type: ignore[overload-overlap]
        query: npt.NDArray[SelfComputed], key: npt.NDArray[SelfComputed],
        value: npt.NDArray[SelfComputed], attn_mask: Mask = ..., dropout_p: float = ...,
        is_causal: bool = ..., scale: float | None = ..., enable_gqa: bool = ..., *,
        return_lse: Literal[True], out: npt.NDArray[SelfComputed] | None = ...,
        seed: int | None = ...,
        **variants: "Unpack[ForwardVariants]"
) -> tuple[npt.NDArray[SelfComputed], npt.NDArray[SelfComputed]]: ...


@overload
def scaled_dot_product_attention(
        query: ArrayT, key: ArrayT, value: ArrayT, attn_mask: Mask = ..., dropout_p: float = ...,
        is_causal: bool = ..., scale: float | None = ..., enable_gqa: bool = ..., *,
        return_lse: Literal[False] = ..., out: ArrayT | None = ..., seed: int | None = ...,
        **variants: "Unpack[ForwardVariants]"
) -> ArrayT: ...


@overload
def scaled_dot_product_attention(
        query: ArrayT, key: ArrayT, value: ArrayT, attn_mask: Mask = ..., dropout_p: float = ...,
        is_causal: bool = ..., scale: float | None = ..., enable_gqa: bool = ..., *,
        return_lse: Literal[True], out: ArrayT | None = ..., seed: int | None = ...,
        **variants: "Unpack[ForwardVariants]"
) -> tuple[ArrayT, ArrayT]: ...


@overload
def scaled_dot_product_attention(
        query: ArrayT, key: ArrayT, value: ArrayT, attn_mask: Mask = ..., dropout_p: float = ...,
        is_causal: bool = ..., scale: float | None = ..., enable_gqa: bool = ..., *,
        return_lse: bool, out: ArrayT | None = ..., seed: int | None = ...,
        **variants: "Unpack[ForwardVariants]"
) -> ArrayT | tuple[ArrayT, Any]: ...


@takes_variants()
def scaled_dot_product_attention(query: Any, key: Any, value: Any, attn_mask: Mask = None,
                                 dropout_p: float = 0.0, is_causal: bool = False,
                                 scale: float | None = None, enable_gqa: bool = False, *,
                                 return_lse: bool = False, out: Any = None,
                                 seed: int | None = None, **variants: Any) -> Any:
    """Attention(Q, K, V) = softmax(Q Kᵀ · scale + mask) V, with torch's semantics.

    Parameters
    ----------
    query : ndarray or CUDA array, shape (..., Hq, L, E)
        2-D ``(L, E)`` and 3-D inputs work too. float16, bfloat16 (``ml_dtypes.bfloat16``),
        float32 or float64; any strides.
    key : ndarray or CUDA array, shape (..., H, S, E)
    value : ndarray or CUDA array, shape (..., H, S, Ev)
        Leading (batch) dims of the three broadcast as in NumPy.
    attn_mask : ndarray, optional
        bool (True = takes part) or the query's float dtype (added to the scores; ``-inf``
        allowed), broadcastable to ``(..., Hq, L, S)``. Read in place through its strides.
        Combines with ``is_causal``.
    dropout_p : float
        Probability in [0, 1) of dropping each attention probability; kept ones are scaled by
        ``1 / (1 - p)`` (torch's semantics; ``lse`` is that of the softmax before dropout).
        The mask is a counter-based random stream of ``(seed, batch, head, row, key)`` (see
        :mod:`sdpa_numba.dropout`): never stored, redrawn by the backward from the seed. The
        CPU and CUDA kernels draw the same mask for the same seed.
    is_causal : bool
        Query ``i`` sees keys ``j <= i`` (top-left aligned, as torch).
    scale : float, optional
        Multiplies ``Q Kᵀ``; default ``1 / sqrt(E)``. Must be finite.
    enable_gqa : bool
        Grouped-query attention: ``Hq`` a multiple of ``H``, query head ``h`` uses key/value
        head ``h // (Hq // H)``. Without it, head dims broadcast like batch dims.
    return_lse : bool, keyword-only
        Also return the log-sum-exp of each row's scores, shape ``(..., Hq, L)``, in the
        compute dtype (float32 for float16/bfloat16/float32 inputs, float64 for float64).
    out : array, keyword-only, optional
        Buffer of the output's shape and dtype, written in place and returned.
    seed : int, keyword-only, optional
        Seed of the dropout mask, in ``[0, 2**64)``: the same seed gives the same mask. None
        draws a fresh one, which the caller cannot know: pass a seed when the backward
        (:func:`~sdpa_numba.scaled_dot_product_attention_backward`) must replay the mask.
        Ignored when ``dropout_p == 0``.

    Other Parameters
    ----------------
    window : (int or None, int or None), keyword-only, optional
        Sliding window ``(left, right)``: query row ``i`` sees keys ``j`` with
        ``i' - left <= j <= i' + right`` (``i'`` is ``i`` in the aligned frame, see
        ``alignment``); None on a side is unlimited. With ``is_causal``, ``right`` is at most 0.
        Sides must be >= 0.
    chunk : int, keyword-only, optional
        Chunked local attention (Llama 4's ``attention_chunk``): positions fall into chunks of
        ``chunk`` from position 0, and query row ``i`` sees only keys ``j`` of its own chunk,
        ``i' // chunk == j // chunk`` (``i'`` as for ``window``: with
        ``alignment="bottom_right"``, ``i + S - L``; a row at a negative position sees no
        key), on top of ``is_causal``, ``window`` and the masks. Key blocks outside a row
        block's chunks are skipped, forward and backward. An int >= 1; None: no chunks.
    alignment : {"top_left", "bottom_right"}, keyword-only
        Where row ``i`` sits among the keys, for ``is_causal``, ``window`` and ALiBi:
        ``i' = i`` (top-left, torch's ``is_causal``) or ``i' = i + S - L`` (bottom-right: the
        last query sees the last key, FlashAttention's causal, for KV caches and chunked
        prefill).
    softcap : float, keyword-only, optional
        Soft-caps the scaled score: ``s <- softcap * tanh(s / softcap)`` (Gemma 2, Grok).
        Finite and > 0.
    alibi_slopes : ndarray, keyword-only, optional
        float32 or float64 of shape ``(Hq,)`` or with batch dims broadcastable to the scores'
        ``(..., Hq)``: adds ``-slope * |i' - j|`` to the score (ALiBi).
    sinks : ndarray, keyword-only, optional
        float32 or float64 of shape ``(Hq,)``: one logit per head that joins every row's
        softmax denominator (``exp(sink)`` is added to the sum; no value row); ``lse``
        includes it. ``-inf``: no sink for that head.
    score_mod : Numba @njit function, keyword-only, optional
        ``score_mod(score, b, h, i, j, *mod_args) -> float``: changes the score of query row
        ``i``, key ``j`` of query head ``h`` and flat batch index ``b`` (after the soft cap and
        ALiBi, before a float ``attn_mask`` is added). Compiled into the kernel.
    mask_mod : Numba @njit function, keyword-only, optional
        ``mask_mod(b, h, i, j, *mod_args) -> bool``: False masks the key out. Without a
        ``block_mask``, the call builds one (above a small size): empty blocks are skipped,
        full ones skip the per-element test; partial blocks evaluate it per element.
    mod_args : tuple, keyword-only
        Arrays and numbers passed to ``score_mod``, ``mask_mod`` and ``score_mod_grad`` as
        their last arguments, at run time: changing their contents never recompiles.
    score_mod_grad : Numba @njit function, keyword-only, optional
        ``d score_mod / d score``, same arguments as ``score_mod``; needed by the backward
        only (checked, then ignored here).
    block_mask : sdpa_numba.BlockMask, keyword-only, optional
        From :func:`sdpa_numba.create_block_mask` for this ``mask_mod`` and ``mod_args``:
        empty blocks are skipped and full ones skip the per-element ``mask_mod``. It carries
        its ``mask_mod``, so ``mask_mod`` may be omitted. Made once and passed to many calls,
        it saves each call building its own.

    Returns
    -------
    out : array of the inputs' dtype and kind, shape (..., Hq, L, Ev)
    lse : array, only with ``return_lse=True``

    Raises
    ------
    TypeError, ValueError
        For bad input, naming the argument, before any kernel runs (including a
        ``score_mod`` or ``mask_mod`` that is not a Numba ``@njit`` function, takes the wrong
        number of arguments or returns the wrong type).
    NotImplementedError
        For variants on a back end that cannot run them yet. For bfloat16 CUDA arrays other than Numba device arrays of ``ml_dtypes.bfloat16`` and
        torch tensors (others' ``__cuda_array_interface__`` does not say bfloat16).

    Notes
    -----
    The scores matrix is never built: the kernels stream key/value blocks with an online
    softmax. A row whose every key is masked gives zeros (and ``lse = -inf``); ``S = 0`` too.
    float16 and bfloat16 compute with float32 accumulators; a bfloat16 output is rounded to
    nearest even. Results do not depend on the thread count.

    The score of ``(b, h, i, j)`` is formed in this order: ``scale * q_i . k_j``, soft cap,
    ALiBi, ``score_mod``, float ``attn_mask`` added; then the window (and causality), the chunk, a bool
    ``attn_mask`` and ``mask_mod`` mask it (see the documentation's variants page). With
    ``sinks``, a row whose every key is masked gives zeros and ``lse`` = its head's sink.
    """
    target = target_of([("query", query), ("key", key), ("value", value),
                        ("attn_mask", attn_mask), ("out", out)], ("query", "key", "value"))
    arrays, restore = target.adopt([("query", query), ("key", key), ("value", value),
                                    ("attn_mask", attn_mask)], out)
    query, key, value, attn_mask = arrays[:4]
    out = arrays[4] if out is not None else None
    check_names("scaled_dot_product_attention", variants, target=target)
    p = plan(query, key, value, attn_mask, is_causal, scale, enable_gqa, **variants)
    dropout_p = check_dropout(dropout_p)
    seed = check_seed(seed)
    return_lse = check_flag("return_lse", return_lse)
    inputs = [("query", query), ("key", key), ("value", value), ("attn_mask", attn_mask)]
    target.check_strides([*inputs, ("out", out)])
    if out is not None:
        check_out(p, out, inputs, target.address)
    dropout = None
    if dropout_p > 0:
        dropout = dropout_params(dropout_p, new_seed() if seed is None else seed)
    result, lse = target.forward(p, query, key, value, attn_mask, out, dropout)
    result, lse = restore(result), restore(lse)
    return (result, lse) if return_lse else result
