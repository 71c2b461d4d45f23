"""The dense operators ``torch.ops.sdpa_numba.attention_forward`` and ``attention_backward``
on :func:`sdpa_numba.scaled_dot_product_attention` and its backward, with their fake (meta)
kernels.

Their schemas end with the variants' arguments (:func:`.tensors.op_schema`, from
:mod:`sdpa_numba.problem.variant_table`): the window's sides, ``alignment``, ``softcap``, and
one ``Tensor?`` per array-valued variant (ALiBi slopes, sinks)."""

import numpy as np
import torch

from ..api import scaled_dot_product_attention as _forward
from ..backward import scaled_dot_product_attention_backward as _backward
from ..problem.variant_table import WITH_GRAD
from .tensors import (as_tensor, check_devices, define_op, host_tensors, kernel_seed,
                      lse_dtype, op_variants, operand, out_shape, variant_keywords)

#: The forward's own arguments (before the variants').
FORWARD_ARGS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale",
                "enable_gqa", "seed")
#: The backward's own arguments.
BACKWARD_ARGS = ("grad_out", "query", "key", "value", "out", "lse", "attn_mask", "dropout_p",
                 "is_causal", "scale", "enable_gqa", "seed", "mask_grad")
#: The gradients of the variants that have one, after (dq, dk, dv, dmask) in the backward's
#: results: one tensor each (empty when the variant is not given).
GRAD_NAMES = tuple(v.name for v in WITH_GRAD)


def _check_devices(op, tensors, seed, variants):
    check_devices(op, tensors, [("seed", seed), *host_tensors(variants)])


def _check_forward_devices(query, key, value, attn_mask, seed, variants):
    _check_devices("attention_forward", [("query", query), ("key", key), ("value", value),
                                         ("attn_mask", attn_mask)], seed, variants)


def _attention_forward(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa,
                       seed, *variants):
    """``(out, lse)`` of :func:`sdpa_numba.scaled_dot_product_attention` (``lse`` in the
    compute dtype: float32 for float16/float32, float64 for float64). The window's sides are
    ``window_left`` and ``window_right`` (both None: no window)."""
    variants = op_variants(variants)
    _check_forward_devices(query, key, value, attn_mask, seed, variants)
    out, lse = _forward(operand(query, "query"), operand(key, "key"),
                        operand(value, "value"), operand(attn_mask, "attn_mask", True),
                        dropout_p, is_causal, scale, enable_gqa, return_lse=True,
                        seed=kernel_seed(seed), **variant_keywords(variants))
    return as_tensor(out), as_tensor(lse)


attention_forward = define_op(
    "attention_forward", _attention_forward,
    "Tensor query, Tensor key, Tensor value, Tensor? attn_mask, float dropout_p, "
    "bool is_causal, float? scale, bool enable_gqa, Tensor? seed")


@attention_forward.register_fake
def _(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, seed, *variants):
    _check_forward_devices(query, key, value, attn_mask, seed, op_variants(variants))
    shape = out_shape(query, key, value, enable_gqa)
    return (query.new_empty(shape),
            query.new_empty(shape[:-1], dtype=lse_dtype(query.dtype)))


def _check_backward_devices(grad_out, query, key, value, out, lse, attn_mask, seed, variants):
    _check_devices("attention_backward",
                   [("grad_out", grad_out), ("query", query), ("key", key), ("value", value),
                    ("out", out), ("lse", lse), ("attn_mask", attn_mask)], seed, variants)


def _attention_backward(grad_out, query, key, value, out, lse, attn_mask, dropout_p, is_causal,
                        scale, enable_gqa, seed, mask_grad, *variants):
    """``(dq, dk, dv, dmask, *dvariants)`` of
    :func:`sdpa_numba.scaled_dot_product_attention_backward`; ``dmask`` is an empty tensor
    unless ``mask_grad``; one gradient per variant that has one (:data:`GRAD_NAMES`: the
    sinks), an empty tensor unless it is given (then its shape, dtype and device). ALiBi
    slopes get no gradient."""
    variants = op_variants(variants)
    _check_backward_devices(grad_out, query, key, value, out, lse, attn_mask, seed, variants)
    grads = _backward(operand(grad_out, "grad_out"), operand(query, "query"),
                      operand(key, "key"), operand(value, "value"), operand(out, "out"),
                      operand(lse, "lse"), operand(attn_mask, "attn_mask", True), dropout_p,
                      is_causal, scale, enable_gqa, seed=kernel_seed(seed),
                      mask_grad=mask_grad, **variant_keywords(variants))
    dq, dk, dv = (as_tensor(g) for g in grads[:3])
    dm = as_tensor(grads[3]) if mask_grad else query.new_empty(0)
    return (dq, dk, dv, dm, *variant_grads(grads[3 + mask_grad:], variants, query))


attention_backward = define_op(
    "attention_backward", _attention_backward,
    "Tensor grad_out, Tensor query, Tensor key, Tensor value, Tensor out, "
    "Tensor lse, Tensor? attn_mask, float dropout_p, bool is_causal, float? scale, "
    "bool enable_gqa, Tensor? seed, bool mask_grad", 4 + len(GRAD_NAMES))


def variant_grads(grads, variants, like):
    """The variants' gradients as tensors of their dtype and device (the API returns them
    last, host arrays in the float dtype each was given in, only for those given), or empty
    tensors for those not given: one per :data:`GRAD_NAMES`."""
    grads = iter(grads)
    result = []
    for name in GRAD_NAMES:
        t = variants[name]
        if t is None:
            result.append(like.new_empty(0))
        else:
            g = torch.from_numpy(np.ascontiguousarray(next(grads)))
            result.append(g.to(device=t.device, dtype=t.dtype))
    return tuple(result)


def fake_variant_grads(variants, like):
    """What :func:`variant_grads` gives, as new (fake) tensors."""
    return tuple(like.new_empty(0) if variants[name] is None
                 else variants[name].new_empty(variants[name].shape) for name in GRAD_NAMES)


@attention_backward.register_fake
def _(grad_out, query, key, value, out, lse, attn_mask, dropout_p, is_causal, scale,
      enable_gqa, seed, mask_grad, *variants):
    variants = op_variants(variants)
    _check_backward_devices(grad_out, query, key, value, out, lse, attn_mask, seed, variants)

    def like(t):
        return t.new_empty(t.shape)  # contiguous, as the real kernel's results

    return (like(query), like(key), like(value),
            like(attn_mask) if mask_grad else query.new_empty(0),
            *fake_variant_grads(variants, query))
