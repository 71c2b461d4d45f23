"""The varlen operators ``torch.ops.sdpa_numba.varlen_attention_forward`` and
``varlen_attention_backward`` on :func:`sdpa_numba.varlen_attention` and its backward
(ragged batches packed back to back), with their fake (meta) kernels."""

from typing import Optional, Tuple

import torch
from torch import Tensor

from ..varlen import varlen_attention as _varlen
from ..varlen import varlen_attention_backward as _varlen_backward
from .dense import sinks_grad
from .tensors import (as_tensor, check_devices, index_operand, kernel_seed, lse_dtype, operand,
                      variant_keywords)


def _check_devices(op, tensors, cu_seqlens_q, cu_seqlens_k, seed, alibi_slopes, sinks):
    check_devices(op, tensors, [("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k),
                                ("seed", seed), ("alibi_slopes", alibi_slopes),
                                ("sinks", sinks)])


@torch.library.custom_op("sdpa_numba::varlen_attention_forward", mutates_args=())
def varlen_attention_forward(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor,
                             cu_seqlens_k: Tensor, max_seqlen_q: Optional[int],
                             max_seqlen_k: Optional[int], dropout_p: float, is_causal: bool,
                             scale: Optional[float], seed: Optional[Tensor],
                             window_left: Optional[int] = None,
                             window_right: Optional[int] = None, alignment: str = "top_left",
                             softcap: Optional[float] = None,
                             alibi_slopes: Optional[Tensor] = None,
                             sinks: Optional[Tensor] = None) -> Tuple[Tensor, Tensor]:
    """``(out, lse)`` of :func:`sdpa_numba.varlen_attention` on packed ``q`` ``(total_q, Hq,
    E)``, ``k`` / ``v`` ``(total_k, H, ·)``: ``out`` ``(total_q, Hq, Ev)``, ``lse`` ``(Hq,
    total_q)`` in the compute dtype. ``cu_seqlens_*``: int32/int64 tensors ``(B + 1,)``, read
    on the host. ``seed`` and the variants as in :func:`attention_forward`."""
    _check_devices("varlen_attention_forward", [("q", q), ("k", k), ("v", v)], cu_seqlens_q,
                   cu_seqlens_k, seed, alibi_slopes, sinks)
    out, lse = _varlen(operand(q, "q"), operand(k, "k"), operand(v, "v"),
                       index_operand(cu_seqlens_q, "cu_seqlens_q"),
                       index_operand(cu_seqlens_k, "cu_seqlens_k"),
                       max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k,
                       is_causal=is_causal, scale=scale, dropout_p=dropout_p,
                       seed=kernel_seed(seed), return_lse=True,
                       **variant_keywords(window_left, window_right, alignment, softcap,
                                          alibi_slopes, sinks))
    return as_tensor(out), as_tensor(lse)


@varlen_attention_forward.register_fake
def _(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, is_causal,
      scale, seed, window_left=None, window_right=None, alignment="top_left", softcap=None,
      alibi_slopes=None, sinks=None):
    _check_devices("varlen_attention_forward", [("q", q), ("k", k), ("v", v)], cu_seqlens_q,
                   cu_seqlens_k, seed, alibi_slopes, sinks)
    # the shapes depend on the inputs' shapes only (symbolic under torch.compile)
    total_q, hq = q.shape[:2]
    return (q.new_empty((total_q, hq, v.shape[-1])),
            q.new_empty((hq, total_q), dtype=lse_dtype(q.dtype)))


@torch.library.custom_op("sdpa_numba::varlen_attention_backward", mutates_args=())
def varlen_attention_backward(grad_out: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor,
                              lse: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor,
                              dropout_p: float, is_causal: bool, scale: Optional[float],
                              seed: Optional[Tensor], window_left: Optional[int] = None,
                              window_right: Optional[int] = None,
                              alignment: str = "top_left", softcap: Optional[float] = None,
                              alibi_slopes: Optional[Tensor] = None,
                              sinks: Optional[Tensor] = None
                              ) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """``(dq, dk, dv, dsinks)`` of :func:`sdpa_numba.varlen_attention_backward`; ``dsinks``
    an empty tensor unless ``sinks`` is given (then the sinks' shape, dtype and device).
    ALiBi slopes get no gradient."""
    _check_backward_devices(grad_out, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, seed,
                            alibi_slopes, sinks)
    grads = _varlen_backward(operand(grad_out, "grad_out"), operand(q, "q"),
                             operand(k, "k"), operand(v, "v"), operand(out, "out"),
                             operand(lse, "lse"), index_operand(cu_seqlens_q, "cu_seqlens_q"),
                             index_operand(cu_seqlens_k, "cu_seqlens_k"), is_causal=is_causal,
                             scale=scale, dropout_p=dropout_p, seed=kernel_seed(seed),
                             **variant_keywords(window_left, window_right, alignment, softcap,
                                                alibi_slopes, sinks))
    dq, dk, dv = (as_tensor(g) for g in grads[:3])
    return dq, dk, dv, sinks_grad(grads, sinks, q)


def _check_backward_devices(grad_out, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, seed,
                            alibi_slopes, sinks):
    _check_devices("varlen_attention_backward",
                   [("grad_out", grad_out), ("q", q), ("k", k), ("v", v), ("out", out),
                    ("lse", lse)], cu_seqlens_q, cu_seqlens_k, seed, alibi_slopes, sinks)


@varlen_attention_backward.register_fake
def _(grad_out, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, dropout_p, is_causal, scale,
      seed, window_left=None, window_right=None, alignment="top_left", softcap=None,
      alibi_slopes=None, sinks=None):
    _check_backward_devices(grad_out, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, seed,
                            alibi_slopes, sinks)
    return (q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape),
            sinks.new_empty(sinks.shape) if sinks is not None else q.new_empty(0))
