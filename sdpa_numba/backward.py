"""The public backward: validation (shared with the forward: :mod:`sdpa_numba.problem`) and
dispatch through the operands' target (:mod:`sdpa_numba.targets`)."""

from typing import TYPE_CHECKING, Any, Literal, overload

import numpy as np

from ._typing import ArrayT, Mask
from .dropout import params as dropout_params
from .problem import check_dropout, check_flag, check_seed, plan, shape_str
from .problem.variant_table import check_names, takes_variants, variant_grads
from .targets import target_of

if TYPE_CHECKING:
    from typing_extensions import Unpack

    from ._typing import Variants


def _check_like(name, x, shape, dtype, what):
    if tuple(x.shape) != tuple(shape) or np.dtype(x.dtype) != dtype:
        raise ValueError(f"{name} must have {what}'s shape {tuple(shape)} and dtype {dtype}, "
                         f"got {shape_str(x)} {np.dtype(x.dtype)}")


@overload
def scaled_dot_product_attention_backward(
        grad_out: ArrayT, query: ArrayT, key: ArrayT, value: ArrayT, out: ArrayT, lse: Any,
        attn_mask: Mask = ..., dropout_p: float = ..., is_causal: bool = ...,
        scale: float | None = ..., enable_gqa: bool = ..., *, seed: int | None = ...,
        mask_grad: Literal[False] = ..., sinks: None = ...,
        **variants: "Unpack[Variants]") -> tuple[ArrayT, ArrayT, ArrayT]: ...


@overload
def scaled_dot_product_attention_backward(
        grad_out: ArrayT, query: ArrayT, key: ArrayT, value: ArrayT, out: ArrayT, lse: Any,
        attn_mask: Mask = ..., dropout_p: float = ..., is_causal: bool = ...,
        scale: float | None = ..., enable_gqa: bool = ..., *, seed: int | None = ...,
        mask_grad: Literal[True], sinks: None = ...,
        **variants: "Unpack[Variants]") -> tuple[ArrayT, ArrayT, ArrayT, ArrayT]: ...


@overload
def scaled_dot_product_attention_backward(
        grad_out: ArrayT, query: ArrayT, key: ArrayT, value: ArrayT, out: ArrayT, lse: Any,
        attn_mask: Mask = ..., dropout_p: float = ..., is_causal: bool = ...,
        scale: float | None = ..., enable_gqa: bool = ..., *, seed: int | None = ...,
        mask_grad: bool = ..., sinks: Any = ...,
        **variants: "Unpack[Variants]") -> tuple[Any, ...]: ...


@takes_variants()
def scaled_dot_product_attention_backward(
        grad_out: Any, query: Any, key: Any, value: Any, out: Any, lse: Any,
        attn_mask: Mask = None, dropout_p: float = 0.0, is_causal: bool = False,
        scale: float | None = None, enable_gqa: bool = False, *, seed: int | None = None,
        mask_grad: bool = False, **variants: Any) -> tuple[Any, ...]:
    """Gradients of :func:`~sdpa_numba.scaled_dot_product_attention` (FlashAttention-2's
    backward: the probabilities are recomputed from ``lse``, never stored).

    Parameters
    ----------
    grad_out : ndarray or CUDA array, shape (..., Hq, L, Ev)
        Gradient of the loss with respect to the forward's output; the inputs' dtype.
    query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa
        Exactly as given to the forward (same checks).
    out, lse : ndarray or CUDA array
        What the forward returned with ``return_lse=True``: ``out`` of the output's shape and
        dtype, ``lse`` of shape ``(..., Hq, L)`` in the compute dtype (float32 for float16,
        bfloat16 and float32 inputs, float64 for float64). All arrays are NumPy arrays (CPU kernels)
        or all CUDA arrays (Numba device arrays, CuPy, PyTorch CUDA tensors: CUDA kernels,
        gradients returned as the query's kind of array).
    seed : int, keyword-only
        The seed the forward used; required when ``dropout_p > 0`` (the dropout mask is
        regenerated from it, see :mod:`sdpa_numba.dropout`).
    mask_grad : bool, keyword-only
        Also return the gradient of a float ``attn_mask`` (of the scores it is added to),
        summed over the dims along which the mask was broadcast. Needs a float mask; builds
        an array of the full scores' shape ``(..., Hq, L, S)`` before the reduction.

    Other Parameters
    ----------------
    sinks, window, chunk, alignment, softcap, alibi_slopes, score_mod, mask_mod, mod_args, block_mask : as in the forward
        The variants, keyword-only, exactly as given to the forward (see
        :func:`~sdpa_numba.scaled_dot_product_attention`).
    score_mod_grad : Numba @njit function, keyword-only
        ``score_mod_grad(score, b, h, i, j, *mod_args)``: the derivative of ``score_mod``
        with respect to its ``score`` at that score. Required with a ``score_mod``.

    Returns
    -------
    grad_query, grad_key, grad_value : ndarray or CUDA array
        The shapes and dtype of ``query``, ``key``, ``value``: gradients of broadcast inputs
        are summed over their broadcast dims; with ``enable_gqa``, key/value gradients are
        summed over the query heads of each group. float16 and bfloat16 are computed in
        float32 (``D = rowsum(dO * O)`` from the stored, rounded ``out``, as torch does) and
        rounded to nearest even.
    grad_attn_mask : ndarray or CUDA array, only with ``mask_grad=True``
        The mask's shape and dtype.
    grad_sinks : ndarray, only with ``sinks``
        A NumPy array of the sinks' shape ``(Hq,)`` and dtype: ``d sink_h = -sum_{b,i}
        exp(sink_h - lse_{b,h,i}) D_{b,h,i}``, ``D = rowsum(grad_out * out)``, accumulated in
        float64. It comes last: ``(grad_query, grad_key, grad_value[, grad_attn_mask][,
        grad_sinks])``.

    The soft cap's gradient is analytic; ALiBi slopes get none (they are constants here);
    windows, causality, bool masks and ``mask_mod`` have none.

    Raises
    ------
    TypeError, ValueError
        For bad input (including host and device arrays mixed), naming the argument, before
        any kernel runs.
    NotImplementedError
        For bfloat16 CUDA arrays other than Numba device arrays of ``ml_dtypes.bfloat16`` and
        torch tensors.

    Notes
    -----
    Rows whose every key is masked get zero gradients. The result is bitwise the same for
    any thread count and on every launch (no atomics; every sum in a fixed order). Memory
    beyond the gradients, on the CPU: O((E + Ev) · min(S, 4096)) per running task, plus, when
    batch x heads is small (< 16) and the keys are split into groups for parallelism, one
    partial dQ per group (at most 16); on the GPU: one value per query row (``D``) and shared
    memory. Never L x S (except the ``mask_grad`` array above). The gradients are computed in
    the compute dtype at the broadcast shapes, then reduced and cast (on the GPU, on the
    device: see :mod:`sdpa_numba.gpu.backward`).
    """
    named = [("query", query), ("grad_out", grad_out), ("key", key), ("value", value),
             ("out", out), ("lse", lse), ("attn_mask", attn_mask)]
    target = target_of(named, ("query", "grad_out", "key", "value", "out", "lse"))
    # As in the forward: the arrays the back end reads (no copy), results as the caller's kind.
    (query, grad_out, key, value, out, lse, attn_mask), restore = target.adopt(named)
    check_names("scaled_dot_product_attention_backward", variants, target=target)
    p = plan(query, key, value, attn_mask, is_causal, scale, enable_gqa, backward=True,
             **variants)
    dropout_p = check_dropout(dropout_p)
    seed = check_seed(seed)
    mask_grad = check_flag("mask_grad", mask_grad)
    _check_like("grad_out", grad_out, p.out_shape, p.dtype, "the output")
    _check_like("out", out, p.out_shape, p.dtype, "the output")
    _check_like("lse", lse, p.out_shape[:-1], p.compute_dtype,
                "the forward's log-sum-exp (compute dtype)")
    if mask_grad and p.mask_kind != "additive":
        raise ValueError("mask_grad=True needs a float attn_mask (a bool mask or no mask has "
                         "no gradient)")
    if dropout_p > 0 and seed is None:
        raise ValueError("dropout_p > 0 needs the seed the forward used: the backward "
                         "regenerates the dropout mask from it")
    target.check_strides([("grad_out", grad_out), ("query", query), ("key", key),
                          ("value", value), ("out", out), ("lse", lse),
                          ("attn_mask", attn_mask)])
    dropout = dropout_params(dropout_p, seed) if dropout_p > 0 and seed is not None else None
    grads = target.backward(p, grad_out, query, key, value, attn_mask, out, lse, dropout,
                            mask_grad)
    grads = [None if g is None else restore(g) for g in grads]
    result = tuple(grads) if mask_grad else tuple(grads[:3])
    host = target.to_host
    return result + variant_grads(p.recipe, variants,
                                  lambda: (host(grad_out), host(out), host(lse)))
