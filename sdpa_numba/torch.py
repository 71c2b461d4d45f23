"""PyTorch autograd on sdpa_numba's kernels: ``sdpa_numba.torch.scaled_dot_product_attention``.

A :class:`torch.autograd.Function` with torch's signature (plus ``seed``) whose forward and
backward are :func:`sdpa_numba.scaled_dot_product_attention` and
:func:`sdpa_numba.scaled_dot_product_attention_backward`:

* CPU tensors run on the CPU kernels, through NumPy views of the tensors
  (``tensor.detach().numpy()``: no copies);
* CUDA tensors run on the CUDA kernels, through ``__cuda_array_interface__`` (no copies
  either); results and gradients are CUDA tensors on the inputs' device. Numba launches on the
  legacy default stream: tensors produced on another torch stream must be synchronized with it
  first. This path needs numba-cuda and a GPU (it is tested on a real GPU only, see
  ``tests/cuda/test_cuda_backward.py``), and refuses bfloat16 (NotImplementedError).

Other devices raise NotImplementedError. Mixing CPU and CUDA tensors is a TypeError.

torch is an optional dependency (the ``bench`` extra): this module imports it, the package
does not. (``import torch`` below is an absolute import: it is the real torch, not this
module.)
"""

import numpy as np
import torch

from .api import scaled_dot_product_attention as _forward
from .backward import scaled_dot_product_attention_backward as _backward
from .dropout import new_seed

__all__ = ["scaled_dot_product_attention", "SDPAFunction"]


def _operand(t, name):
    """What the kernels take for tensor ``t``: a NumPy view of a CPU tensor, the detached
    CUDA tensor itself (the API adopts it without a copy), None for None."""
    if t is None:
        return None
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.device.type not in ("cpu", "cuda"):
        raise NotImplementedError(
            f"{name} is on {t.device}: sdpa_numba.torch supports CPU and CUDA tensors only")
    if t.device.type == "cuda" and t.dtype == torch.bfloat16:
        raise NotImplementedError(f"{name} is bfloat16: the CUDA kernels do not support "
                                  f"bfloat16 yet; use float16 or float32")
    if t.dtype not in (torch.float16, torch.float32, torch.float64, torch.bool):
        raise TypeError(f"{name} dtype {t.dtype} is not supported: use float16, float32 or "
                        f"float64 (bool for attn_mask)")
    return t.detach().numpy() if t.device.type == "cpu" else t.detach()


def _tensor(x):
    """A result of the kernels as a tensor: CUDA results already are (the query's kind)."""
    return x if isinstance(x, torch.Tensor) else torch.from_numpy(np.ascontiguousarray(x))


class SDPAFunction(torch.autograd.Function):
    """Attention with FlashAttention-2's backward. ``apply(query, key, value, attn_mask,
    dropout_p, is_causal, scale, enable_gqa, seed)``; the seed is drawn here when None and
    kept (in ``ctx``) for the backward, so dropout masks always replay."""

    @staticmethod
    def forward(ctx, query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa,
                seed):
        q, k, v = _operand(query, "query"), _operand(key, "key"), _operand(value, "value")
        m = _operand(attn_mask, "attn_mask")
        if dropout_p > 0 and seed is None:
            seed = new_seed()
        out, lse = _forward(q, k, v, m, dropout_p, is_causal, scale, enable_gqa,
                            return_lse=True, seed=seed)
        out_t = _tensor(out)
        ctx.save_for_backward(query, key, value, attn_mask, out_t, _tensor(lse))
        ctx.args = (dropout_p, is_causal, scale, enable_gqa, seed)
        return out_t

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out):
        query, key, value, attn_mask, out, lse = ctx.saved_tensors
        dropout_p, is_causal, scale, enable_gqa, seed = ctx.args
        mask_grad = (attn_mask is not None and attn_mask.dtype != torch.bool
                     and ctx.needs_input_grad[3])
        grads = _backward(_operand(grad_out, "grad_out"), _operand(query, "query"),
                          _operand(key, "key"), _operand(value, "value"),
                          _operand(out, "out"), _operand(lse, "lse"),
                          _operand(attn_mask, "attn_mask"), dropout_p, is_causal, scale,
                          enable_gqa, seed=seed, mask_grad=mask_grad)
        dq, dk, dv = (_tensor(g) for g in grads[:3])
        dm = _tensor(grads[3]) if mask_grad else None
        return (dq if ctx.needs_input_grad[0] else None,
                dk if ctx.needs_input_grad[1] else None,
                dv if ctx.needs_input_grad[2] else None,
                dm, None, None, None, None, None)


def scaled_dot_product_attention(query, key, value, attn_mask=None, dropout_p=0.0,
                                 is_causal=False, scale=None, enable_gqa=False, *, seed=None):
    """``torch.nn.functional.scaled_dot_product_attention`` on sdpa_numba's CPU or CUDA
    kernels, with autograd (gradients for query, key, value and a float ``attn_mask``).

    Same arguments and semantics as torch's (``dropout_p`` applies whenever it is > 0, as in
    torch's functional form: pass 0 in evaluation). ``seed`` fixes the dropout mask (see
    :mod:`sdpa_numba.dropout`); None draws a fresh one per call, which the backward reuses.
    CPU tensors run on the CPU kernels, CUDA tensors on the CUDA kernels; float16, float32,
    float64. Double backward is not supported.
    """
    return SDPAFunction.apply(query, key, value, attn_mask, dropout_p, is_causal, scale,
                              enable_gqa, seed)
