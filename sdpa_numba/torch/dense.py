"""The dense operators ``torch.ops.sdpa_numba.attention_forward`` and ``attention_backward``
on :func:`sdpa_numba.scaled_dot_product_attention` and its backward, with their fake (meta)
kernels."""

from typing import Optional, Tuple

import numpy as np
import torch
from torch import Tensor

from ..api import scaled_dot_product_attention as _forward
from ..backward import scaled_dot_product_attention_backward as _backward
from .tensors import (as_tensor, check_devices, kernel_seed, lse_dtype, operand, out_shape,
                      variant_keywords)


def _check_devices(op, tensors, seed, alibi_slopes, sinks):
    check_devices(op, tensors, [("seed", seed), ("alibi_slopes", alibi_slopes),
                                ("sinks", sinks)])


@torch.library.custom_op("sdpa_numba::attention_forward", mutates_args=())
def attention_forward(query: Tensor, key: Tensor, value: Tensor, attn_mask: Optional[Tensor],
                      dropout_p: float, is_causal: bool, scale: Optional[float],
                      enable_gqa: bool, seed: Optional[Tensor],
                      window_left: Optional[int] = None, window_right: Optional[int] = None,
                      alignment: str = "top_left", softcap: Optional[float] = None,
                      alibi_slopes: Optional[Tensor] = None,
                      sinks: Optional[Tensor] = None) -> Tuple[Tensor, Tensor]:
    """``(out, lse)`` of :func:`sdpa_numba.scaled_dot_product_attention` (``lse`` in the
    compute dtype: float32 for float16/float32, float64 for float64). The window's sides are
    ``window_left`` and ``window_right`` (both None: no window)."""
    _check_forward_devices(query, key, value, attn_mask, seed, alibi_slopes, sinks)
    out, lse = _forward(operand(query, "query"), operand(key, "key"),
                        operand(value, "value"), operand(attn_mask, "attn_mask", True),
                        dropout_p, is_causal, scale, enable_gqa, return_lse=True,
                        seed=kernel_seed(seed),
                        **variant_keywords(window_left, window_right, alignment, softcap,
                                           alibi_slopes, sinks))
    return as_tensor(out), as_tensor(lse)


def _check_forward_devices(query, key, value, attn_mask, seed, alibi_slopes, sinks):
    _check_devices("attention_forward", [("query", query), ("key", key), ("value", value),
                                         ("attn_mask", attn_mask)], seed, alibi_slopes, sinks)


@attention_forward.register_fake
def _(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, seed,
      window_left=None, window_right=None, alignment="top_left", softcap=None,
      alibi_slopes=None, sinks=None):
    _check_forward_devices(query, key, value, attn_mask, seed, alibi_slopes, sinks)
    shape = out_shape(query, key, value, enable_gqa)
    return (query.new_empty(shape),
            query.new_empty(shape[:-1], dtype=lse_dtype(query.dtype)))


@torch.library.custom_op("sdpa_numba::attention_backward", mutates_args=())
def attention_backward(grad_out: Tensor, query: Tensor, key: Tensor, value: Tensor, out: Tensor,
                       lse: Tensor, attn_mask: Optional[Tensor], dropout_p: float,
                       is_causal: bool, scale: Optional[float], enable_gqa: bool,
                       seed: Optional[Tensor], mask_grad: bool,
                       window_left: Optional[int] = None, window_right: Optional[int] = None,
                       alignment: str = "top_left", softcap: Optional[float] = None,
                       alibi_slopes: Optional[Tensor] = None, sinks: Optional[Tensor] = None
                       ) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """``(dq, dk, dv, dmask, dsinks)`` of
    :func:`sdpa_numba.scaled_dot_product_attention_backward`; ``dmask`` is an empty tensor
    unless ``mask_grad``, ``dsinks`` one unless ``sinks`` is given (then the sinks' shape,
    dtype and device). ALiBi slopes get no gradient."""
    _check_backward_devices(grad_out, query, key, value, out, lse, attn_mask, seed,
                            alibi_slopes, sinks)
    grads = _backward(operand(grad_out, "grad_out"), operand(query, "query"),
                      operand(key, "key"), operand(value, "value"), operand(out, "out"),
                      operand(lse, "lse"), operand(attn_mask, "attn_mask", True), dropout_p,
                      is_causal, scale, enable_gqa, seed=kernel_seed(seed),
                      mask_grad=mask_grad,
                      **variant_keywords(window_left, window_right, alignment, softcap,
                                         alibi_slopes, sinks))
    dq, dk, dv = (as_tensor(g) for g in grads[:3])
    dm = as_tensor(grads[3]) if mask_grad else query.new_empty(0)
    return dq, dk, dv, dm, sinks_grad(grads, sinks, query)


def _check_backward_devices(grad_out, query, key, value, out, lse, attn_mask, seed,
                            alibi_slopes, sinks):
    _check_devices("attention_backward",
                   [("grad_out", grad_out), ("query", query), ("key", key), ("value", value),
                    ("out", out), ("lse", lse), ("attn_mask", attn_mask)],
                   seed, alibi_slopes, sinks)


def sinks_grad(grads, sinks, like):
    """The sinks' gradient as a tensor of the sinks' dtype and device (the API returns it
    last, a host array in the float dtype it was given), or an empty tensor without sinks."""
    if sinks is None:
        return like.new_empty(0)
    ds = torch.from_numpy(np.ascontiguousarray(grads[-1]))
    return ds.to(device=sinks.device, dtype=sinks.dtype)


@attention_backward.register_fake
def _(grad_out, query, key, value, out, lse, attn_mask, dropout_p, is_causal, scale,
      enable_gqa, seed, mask_grad, window_left=None, window_right=None, alignment="top_left",
      softcap=None, alibi_slopes=None, sinks=None):
    _check_backward_devices(grad_out, query, key, value, out, lse, attn_mask, seed,
                            alibi_slopes, sinks)

    def like(t):
        return t.new_empty(t.shape)  # contiguous, as the real kernel's results

    return (like(query), like(key), like(value),
            like(attn_mask) if mask_grad else query.new_empty(0),
            like(sinks) if sinks is not None else query.new_empty(0))
