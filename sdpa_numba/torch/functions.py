"""The PyTorch operator: ``sdpa_numba.torch.scaled_dot_product_attention``.

torch's signature and semantics, on sdpa_numba's kernels, registered with
:func:`torch.library.custom_op` so that the rest of PyTorch sees a real operator:

* ``torch.ops.sdpa_numba.attention_forward(query, key, value, attn_mask, dropout_p, is_causal,
  scale, enable_gqa, seed, window_left=None, window_right=None, alignment="top_left",
  softcap=None, alibi_slopes=None, sinks=None) -> (out, lse)`` and
  ``torch.ops.sdpa_numba.attention_backward(grad_out, query, key, value, out, lse, attn_mask,
  dropout_p, is_causal, scale, enable_gqa, seed, mask_grad, window_left=None,
  window_right=None, alignment="top_left", softcap=None, alibi_slopes=None, sinks=None)
  -> (dq, dk, dv, dmask, dsinks)``;
* the variants that fit an operator schema (see :func:`scaled_dot_product_attention`): a
  sliding window (its two sides as two optional ints), ``alignment``, ``softcap``,
  ``alibi_slopes`` and ``sinks`` (tensors; the sinks get a gradient). ``score_mod``,
  ``mask_mod`` and ``block_mask`` are Numba functions and objects, which no operator schema
  can carry: they stay with the NumPy-level :func:`sdpa_numba.scaled_dot_product_attention`;
* the serving functions: ``torch.ops.sdpa_numba.attention_with_kvcache(q, k_cache, v_cache,
  cache_seqlens, k=None, v=None, block_table=None, cache_leftpad=None, is_causal=True,
  scale=None, window_left=None, window_right=None, alignment=None, softcap=None,
  alibi_slopes=None, sinks=None) -> (out, lse)``, which declares the caches mutated (the
  append) and has no autograd (an inference operator), its read-only twin
  ``torch.ops.sdpa_numba.attention_with_kvcache_read`` (the same without ``k`` and ``v``: no
  declared mutation, whose dispatch is cheaper), and
  ``torch.ops.sdpa_numba.merge_attention_states(out_a, lse_a, out_b=None, lse_b=None)
  -> (out, lse)``, with autograd; wrapped by :func:`attention_with_kvcache` and
  :func:`merge_attention_states`; vmap rules for the read-only KV-cache op (the vmapped dim
  folds into the batch dim) and the merge; the appending op refuses vmap (an in-place write);
* packed ragged batches: ``torch.ops.sdpa_numba.varlen_attention_forward(q, k, v,
  cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, is_causal, scale, seed,
  <the dense op's variants>) -> (out, lse)`` and ``varlen_attention_backward(grad_out, q, k,
  v, out, lse, cu_seqlens_q, cu_seqlens_k, dropout_p, is_causal, scale, seed, <variants>)
  -> (dq, dk, dv, dsinks)``, with autograd (double backward per sequence through the dense
  torch formulation), wrapped by :func:`varlen_attention`;
* fake (meta) kernels for both, so ``torch.compile`` traces through them
  (``fullgraph=True`` works: no graph break) and meta tensors get shapes;
* autograd registered on the forward (gradients for query, key, value and a float
  ``attn_mask``), with double backward: under ``create_graph=True`` the first-order
  gradients are taken through the same attention written in torch operations (L x S memory,
  only then; with every variant of the schema), so that gradient penalties and
  Hessian-vector products get their second-order terms (under torch.compile, AOT autograd
  refuses double backward with its own message);
* vmap rules for both (the vmapped dim becomes one more leading batch dim, batched ALiBi
  slopes included; with sinks, or dropout, one call per vmapped index); torch.func's
  autodiff transforms (``grad``, ``jacrev``, ...) are not supported (NotImplementedError).

Devices: CPU tensors run on the CPU kernels through NumPy views (``tensor.numpy()``: no
copies); CUDA tensors run on the CUDA kernels through ``__cuda_array_interface__`` (no copies
either; numba-cuda and a GPU needed; Numba launches on the legacy default stream, so tensors
made on another torch stream must be synchronized first). dtypes: float16, bfloat16, float32,
float64 (bfloat16 goes through ``ml_dtypes.bfloat16`` NumPy views on the CPU, and int16 bit
patterns on either device, without copies; it needs the ml_dtypes package). Other devices raise NotImplementedError; meta tensors only get
shapes.

Dropout: the forward op takes ``seed``, a 0-dim int64 CPU tensor (or None when
``dropout_p == 0``), and the backward regenerates the same mask from it (see
:mod:`sdpa_numba.dropout`; the int64 is read as the uint64 with the same bits). The function
below draws it from torch's default (CPU) generator (``torch.randint``) when not given, so
``torch.manual_seed`` makes dropout reproducible and ``torch.compile`` keeps it random per call
(inductor draws from its own random stream, as for torch's dropout, unless
``torch._inductor.config.fallback_random`` is set).

Needs torch >= 2.4 (``custom_op``, ``register_fake``, ``register_autograd``); the vmap rules
need 2.5 (``register_vmap``) and are skipped before it. torch is an optional dependency (the
``torch`` extra): this module imports it, the package does not. (``import torch`` below is an
absolute import: it is the real torch, not this module.)
"""

import warnings
from typing import Optional, Tuple

import numpy as np
import torch
from torch import Tensor

from .._bf16 import is_bfloat16
from ..api import scaled_dot_product_attention as _forward
from ..backward import scaled_dot_product_attention_backward as _backward
from ..kvcache import attention_with_kvcache as _kvcache
from ..merge import merge_attention_states as _merge
from ..varlen import varlen_attention as _varlen
from ..varlen import varlen_attention_backward as _varlen_backward
from ..problem import compute_dtype

__all__ = ["scaled_dot_product_attention", "attention_forward", "attention_backward",
           "varlen_attention", "varlen_attention_forward", "varlen_attention_backward",
           "attention_with_kvcache", "merge_attention_states", "attention_with_kvcache_op",
           "attention_with_kvcache_read_op",
           "merge_attention_states_op", "SDPAFunction"]

_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_U64 = 1 << 64

DOUBLE_BACKWARD = (
    "sdpa_numba: the operator torch.ops.sdpa_numba.{op} is not differentiable (its kernels "
    "have no derivative): differentiate sdpa_numba.torch.{func} with create_graph=True "
    "instead, which takes its second-order terms through torch")


# ---------------------------------------------------------------- tensors in and out


def _check_tensor(t, name, mask=False):
    """TypeError / NotImplementedError for what the operator does not take."""
    if t is None:
        return
    if not isinstance(t, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.device.type not in ("cpu", "cuda", "meta"):
        raise NotImplementedError(
            f"{name} is on {t.device}: sdpa_numba.torch supports CPU and CUDA tensors only")
    if t.dtype not in _FLOATS and not (mask and t.dtype == torch.bool):
        raise TypeError(f"{name} dtype {t.dtype} is not supported: use float16, bfloat16, "
                        f"float32 or float64" + (" (or bool)" if mask else ""))


def _operand(t, name, mask=False):
    """What the kernels take for tensor ``t``: a NumPy view of a CPU tensor, the detached
    CUDA tensor itself (the API adopts it without a copy), None for None."""
    if t is None:
        return None
    _check_tensor(t, name, mask)
    if t.device.type != "cpu":
        return t.detach()
    if t.dtype == torch.bfloat16:  # NumPy has no bfloat16: ml_dtypes' over the same bits
        from .._bf16 import bfloat16

        return t.detach().view(torch.int16).numpy().view(bfloat16())
    return t.detach().numpy()


def _tensor(x):
    """A result of the kernels as a new contiguous tensor (CUDA results already are tensors,
    the query's kind)."""
    if isinstance(x, Tensor):
        return x.contiguous()
    x = np.ascontiguousarray(x)
    if is_bfloat16(x.dtype):
        return torch.from_numpy(x.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(x)


def _small(t, name):
    """ALiBi slopes or sinks for the kernels: a float32/float64 NumPy view (a CUDA tensor is
    passed as is: the API copies it to the host), 16-bit tensors as float32 (the API takes
    float32/float64 only; these are per-head numbers, a copy is nothing), or None."""
    if t is None:
        return None
    if not isinstance(t, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor or None, got {type(t).__name__}")
    if t.dtype not in _FLOATS:
        raise TypeError(f"{name} dtype {t.dtype} is not supported: use a floating dtype")
    t = t.detach()
    if t.dtype in (torch.float16, torch.bfloat16):
        t = t.float()
    return t.numpy() if t.device.type == "cpu" else t


def _variants(window_left, window_right, alignment, softcap, alibi_slopes, sinks):
    """The keywords of the NumPy-level API for the op's variant arguments."""
    window = None if window_left is None and window_right is None else (window_left,
                                                                         window_right)
    return dict(window=window, alignment=alignment, softcap=softcap,
                alibi_slopes=_small(alibi_slopes, "alibi_slopes"), sinks=_small(sinks, "sinks"))


def _seed(seed):
    """The kernels' seed (an int in [0, 2**64)) from the op's 0-dim int64 tensor, or None."""
    return None if seed is None else int(seed.item()) % _U64


def _seed_tensor(seed, dropout_p):
    """The op's seed argument: None without dropout; a draw from torch's generator when
    ``seed`` is None; else the int64 with the bits of ``seed`` (an int in [0, 2**64))."""
    if not dropout_p > 0:
        return None
    if seed is None:
        return torch.randint(-(1 << 63), (1 << 63) - 1, (), dtype=torch.int64)
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise TypeError(f"seed must be an int or None, got {type(seed).__name__}")
    if not 0 <= seed < _U64:
        raise ValueError(f"seed must be in [0, 2**64), got {seed}")
    return torch.tensor(seed - _U64 if seed >= 1 << 63 else seed, dtype=torch.int64)


def _lse_dtype(dtype):
    """The compute dtype of a torch dtype (:func:`sdpa_numba.problem.compute_dtype`)."""
    return getattr(torch, compute_dtype(dtype).name)


def _out_shape(query, key, value, enable_gqa):
    """The output's shape, as :func:`sdpa_numba.problem.plan` gives it, in torch terms (so that
    symbolic shapes propagate under torch.compile)."""
    ndims = (query.dim(), key.dim(), value.dim())
    nd = max(*ndims, 3)
    qs, ks, vs = ((1,) * (nd - x.dim()) + tuple(x.shape) for x in (query, key, value))
    batch = tuple(torch.broadcast_shapes(qs[:-3], ks[:-3], vs[:-3]))
    hq = qs[-3] if enable_gqa else torch.broadcast_shapes((qs[-3],), (ks[-3],))[0]
    shape = (*batch, hq, qs[-2], vs[-1])
    return shape[1:] if nd > max(ndims) else shape  # 2-D inputs: no head dim


# ---------------------------------------------------------------- the two operators


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
    out, lse = _forward(_operand(query, "query"), _operand(key, "key"),
                        _operand(value, "value"), _operand(attn_mask, "attn_mask", True),
                        dropout_p, is_causal, scale, enable_gqa, return_lse=True,
                        seed=_seed(seed),
                        **_variants(window_left, window_right, alignment, softcap,
                                    alibi_slopes, sinks))
    return _tensor(out), _tensor(lse)


@attention_forward.register_fake
def _(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, seed,
      window_left=None, window_right=None, alignment="top_left", softcap=None,
      alibi_slopes=None, sinks=None):
    shape = _out_shape(query, key, value, enable_gqa)
    return (query.new_empty(shape),
            query.new_empty(shape[:-1], dtype=_lse_dtype(query.dtype)))


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
    grads = _backward(_operand(grad_out, "grad_out"), _operand(query, "query"),
                      _operand(key, "key"), _operand(value, "value"), _operand(out, "out"),
                      _operand(lse, "lse"), _operand(attn_mask, "attn_mask", True), dropout_p,
                      is_causal, scale, enable_gqa, seed=_seed(seed), mask_grad=mask_grad,
                      **_variants(window_left, window_right, alignment, softcap,
                                  alibi_slopes, sinks))
    dq, dk, dv = (_tensor(g) for g in grads[:3])
    dm = _tensor(grads[3]) if mask_grad else query.new_empty(0)
    return dq, dk, dv, dm, _sinks_grad(grads, sinks, query)


def _sinks_grad(grads, sinks, like):
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
    def like(t):
        return t.new_empty(t.shape)  # contiguous, as the real kernel's results

    return (like(query), like(key), like(value),
            like(attn_mask) if mask_grad else query.new_empty(0),
            like(sinks) if sinks is not None else query.new_empty(0))


# ---------------------------------------------------------------- autograd


_DEFAULTS = (None, None, "top_left", None, None, None)  # the op's variant arguments
_SINKS = 14  # the index of ``sinks`` among the op's arguments


def _setup_context(ctx, inputs, output):
    # torch fills in the arguments left at their defaults (the padding below is only a
    # guard); the backward returns one gradient (or None) per input (ctx.n_inputs)
    ctx.n_inputs = len(inputs)
    (query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, seed,
     window_left, window_right, alignment, softcap, alibi_slopes, sinks) = (
        tuple(inputs) + _DEFAULTS[len(inputs) - 9:])
    out, lse = output
    ctx.mark_non_differentiable(lse)
    ctx.save_for_backward(query, key, value, attn_mask, out, lse, seed, alibi_slopes, sinks)
    ctx.args = (dropout_p, is_causal, scale, enable_gqa)
    ctx.variants = (window_left, window_right, alignment, softcap)


def _dense_attention(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa,
                     seed, window_left=None, window_right=None, alignment="top_left",
                     softcap=None, alibi_slopes=None, sinks=None, batch_index=None):
    """The forward in plain torch operations, building the L x S probabilities: what the
    double backward differentiates twice. Same semantics as the kernels (causal and the
    window in the ``alignment``'s frame, the score formed as scale -> soft cap -> ALiBi ->
    additive mask, then masked; sinks in every row's denominator; fully masked rows give 0;
    the dropout mask of :mod:`sdpa_numba.dropout`). ``batch_index``: 3-D inputs that are
    entry ``batch_index`` of a batch (a varlen sequence), for the dropout stream."""
    from ..dropout import keep_mask

    dtype = query.dtype
    nd = max(query.dim(), key.dim(), value.dim(), 3)
    q, k, v = (x.reshape((1,) * (nd - x.dim()) + tuple(x.shape)) for x in (query, key, value))
    if dtype in (torch.float16, torch.bfloat16):  # the kernels' compute dtype
        q, k, v = q.float(), k.float(), v.float()
    if enable_gqa:
        group = q.shape[-3] // k.shape[-3]
        k, v = k.repeat_interleave(group, dim=-3), v.repeat_interleave(group, dim=-3)
    E = q.shape[-1]
    s = (q @ k.transpose(-1, -2)) * (scale if scale is not None else
                                      (1.0 / E ** 0.5 if E else 1.0))
    L, S = s.shape[-2:]
    # i' - j for every (i, j): the query's position in the alignment's frame minus the key's
    offset = S - L if alignment == "bottom_right" else 0
    rel = (torch.arange(L, device=s.device)[:, None] + offset
           - torch.arange(S, device=s.device)[None, :])
    if softcap is not None:
        s = softcap * torch.tanh(s / softcap)
    if alibi_slopes is not None:
        slopes = alibi_slopes.to(s.dtype)
        s = s - slopes[..., None, None] * rel.abs().to(s.dtype)
    if attn_mask is not None and attn_mask.dtype != torch.bool:
        s = s + attn_mask.to(s.dtype)
    keep = torch.ones(L, S, dtype=torch.bool, device=s.device)
    right = window_right
    if is_causal:
        right = 0 if right is None else min(right, 0)
    if window_left is not None:
        keep &= rel <= window_left
    if right is not None:
        keep &= -rel <= right
    s = s.masked_fill(~keep, -float("inf"))
    if attn_mask is not None and attn_mask.dtype == torch.bool:
        s = s.masked_fill(~attn_mask, -float("inf"))
    m = s.detach().amax(dim=-1, keepdim=True)
    sink = None
    if sinks is not None:  # (Hq,): one logit per head, joining each row's denominator
        sink = sinks.to(s.dtype)[:, None, None]
        m = torch.maximum(m, sink.detach().expand_as(m))
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    p = torch.exp(s - m)
    total = p.sum(dim=-1, keepdim=True)
    if sink is not None:
        total = total + torch.exp(sink - m)
    p = p / torch.where(total > 0, total, torch.ones_like(total))  # masked rows: 0
    if dropout_p > 0:
        if batch_index is None:
            keep = keep_mask(_seed(seed), dropout_p, tuple(p.shape[:-3]), p.shape[-3], L, S)
        else:  # the dense stream of batch entry batch_index
            keep = keep_mask(_seed(seed), dropout_p, (batch_index + 1,), p.shape[-3], L,
                             S)[batch_index]
        p = p * torch.from_numpy(keep).to(p.device) * (1.0 / (1.0 - dropout_p))
    out = (p @ v).to(dtype)
    return out.reshape(_out_shape(query, key, value, enable_gqa))


def _needs_sinks_grad(ctx, sinks, index=_SINKS):
    """Whether autograd wants the sinks' gradient (``index``: the sinks' among the op's
    arguments). (torch 2.13's needs_input_grad can be shorter than the op's arguments,
    covering only those without defaults: then the saved tensor's requires_grad says it.)"""
    if sinks is None:
        return False
    if len(ctx.needs_input_grad) > index:
        return bool(ctx.needs_input_grad[index])
    return sinks.requires_grad


def _double_backward(ctx, grad_out, query, key, value, attn_mask, seed, alibi_slopes, sinks):
    """First-order gradients that are themselves differentiable (``create_graph=True``):
    torch's autograd through :func:`_dense_attention`. O(L x S) memory, only on this path."""
    dropout_p, is_causal, scale, enable_gqa = ctx.args
    need = list(ctx.needs_input_grad[:4]) + [_needs_sinks_grad(ctx, sinks)]
    need[3] = need[3] and attn_mask is not None and attn_mask.is_floating_point()
    need[4] = need[4] and sinks is not None
    # views, so that q, k, v passed as one tensor still get one gradient each
    inputs = [None if t is None else t.view_as(t)
              for t in (query, key, value, attn_mask, sinks)]
    out = _dense_attention(*inputs[:4], dropout_p, is_causal, scale, enable_gqa, seed,
                           *ctx.variants, alibi_slopes=alibi_slopes, sinks=inputs[4])
    return _graph_grads(ctx, out, grad_out, inputs, need, _SINKS)


def _graph_grads(ctx, out, grad_out, inputs, need, sinks_index):
    """The gradients of ``out`` (computed from ``inputs`` in torch operations) for the op's
    arguments, with a graph of their own: ``inputs`` are the leading differentiable
    arguments and the sinks last, ``need`` says which are wanted (zeros for an unused one)."""
    wanted = [t for t, n in zip(inputs, need) if n]
    grads = iter(torch.autograd.grad(out, wanted, grad_out, create_graph=True,
                                     allow_unused=True))
    result = [next(grads) if n else None for n in need]
    result = [torch.zeros_like(t) if n and g is None else g
              for t, n, g in zip(inputs, need, result)]
    grads = [None] * ctx.n_inputs
    grads[:len(result) - 1] = result[:-1]
    if need[-1]:
        grads[sinks_index] = result[-1]
    return tuple(grads)


def _backward_formula(ctx, grad_out, grad_lse):
    query, key, value, attn_mask, out, lse, seed, alibi_slopes, sinks = ctx.saved_tensors
    dropout_p, is_causal, scale, enable_gqa = ctx.args
    # create_graph=True: autograd runs this with grad mode on and wants gradients with a
    # graph of their own, which the kernels cannot give: take them through torch instead.
    if torch.is_grad_enabled() and any(
            t is not None and t.requires_grad
            for t in (grad_out, query, key, value, attn_mask, sinks)):
        return _double_backward(ctx, grad_out, query, key, value, attn_mask, seed,
                                alibi_slopes, sinks)
    need = ctx.needs_input_grad
    mask_grad = bool(attn_mask is not None and attn_mask.is_floating_point() and need[3])
    dq, dk, dv, dm, ds = attention_backward(grad_out, query, key, value, out, lse, attn_mask,
                                            dropout_p, is_causal, scale, enable_gqa, seed,
                                            mask_grad, *ctx.variants, alibi_slopes, sinks)
    grads = [None] * ctx.n_inputs
    grads[:4] = (dq if need[0] else None, dk if need[1] else None, dv if need[2] else None,
                 dm if mask_grad else None)
    if _needs_sinks_grad(ctx, sinks):
        grads[_SINKS] = ds
    return tuple(grads)


attention_forward.register_autograd(_backward_formula, setup_context=_setup_context)


def _no_double_backward(op, func):
    """The autograd formula of a backward operator: a RuntimeError naming ``op`` and the
    function ``func`` to differentiate instead."""
    def refuse(ctx, *grads):
        raise RuntimeError(DOUBLE_BACKWARD.format(op=op, func=func))
    return refuse


def _setup_nothing(ctx, inputs, output):
    pass


# The backward operator called directly on tensors that require grad, then differentiated:
# say what to do instead of torch's generic "no autograd formula".
attention_backward.register_autograd(
    _no_double_backward("attention_backward", "scaled_dot_product_attention"),
    setup_context=_setup_nothing)


# ---------------------------------------------------------------- vmap


def _fold(batch_size, in_dims, tensors, ranks, R):
    """Each tensor with its vmapped dim first (unbatched ones expanded: a view) and ``R`` -
    its logical rank ones after it, so that the vmapped dim lines up as the first batch dim.
    ``ranks`` are the logical ranks; ``R`` is the common logical rank to pad to."""
    folded = []
    for t, d, r in zip(tensors, in_dims, ranks):
        if t is None:
            folded.append(None)
            continue
        t = _leading(batch_size, t, d)
        folded.append(t[(slice(None),) + (None,) * (R - r)])
    return folded


def _leading(batch_size, t, d, at=0):
    """``t`` with the vmapped dim at ``at`` (an unbatched tensor expanded there: a view)."""
    if t is None:
        return None
    if d is not None:
        return t.movedim(d, at)
    shape = list(t.shape)
    shape.insert(at, batch_size)
    return t.unsqueeze(at).expand(shape)


def _logical(t, d):
    return None if t is None else (t.shape if d is None else t.shape[:d] + t.shape[d + 1:])


def _select(t, d, i):
    return t if t is None or d is None else t.select(d, i)


def _vmap_loop(op, info, in_dims, args):
    """Call ``op`` once per vmapped index (dropout: each index draws its own seed's mask, as
    vmap's randomness= mode says) and stack the results."""
    results = [op(*(_select(a, d, i) if isinstance(a, Tensor) else a
                    for a, d in zip(args, in_dims)))
               for i in range(info.batch_size)]
    return tuple(torch.stack(r) for r in zip(*results)), (0,) * len(results[0])


def _all_dims(in_dims, args):
    """``in_dims`` for every argument: the dispatcher leaves out trailing arguments equal to
    their defaults (and their dims), which the vmap rule gets back as its defaults."""
    return tuple(in_dims) + (None,) * (len(args) - len(in_dims))


def _fold_alibi(info, alibi_slopes, d, R):
    """ALiBi slopes under vmap: unbatched ones as they are (they broadcast against the scores'
    batch dims from the right); batched ones with the vmapped dim first and ones after it, as
    the folded scores' batch dims (the slopes' rank is the scores' minus 2)."""
    if alibi_slopes is None or d is None:
        return alibi_slopes
    r = alibi_slopes.dim() - 1
    return _fold(info.batch_size, (d,), (alibi_slopes,), (r + 2,), R)[0]


def _forward_vmap(info, in_dims, query, key, value, attn_mask, dropout_p, is_causal, scale,
                  enable_gqa, seed, window_left=None, window_right=None, alignment="top_left",
                  softcap=None, alibi_slopes=None, sinks=None):
    variants = (window_left, window_right, alignment, softcap)
    args = (query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, seed,
            *variants, alibi_slopes, sinks)
    in_dims = _all_dims(in_dims, args)
    # sinks are (Hq,) per call: batched ones cannot fold into the batch dims, so one call per
    # index (unbatched ones too: simpler, and vmap's per-index sinks gradients need it)
    if dropout_p > 0 or sinks is not None:
        return _vmap_loop(attention_forward, info, in_dims, args)
    tensors, dims = (query, key, value, attn_mask), in_dims[:4]
    shapes = [_logical(t, d) for t, d in zip(tensors, dims)]
    ranks = [None if s is None else len(s) for s in shapes]
    R = max(max(r for r in ranks if r is not None), 3)
    q, k, v, m = _fold(info.batch_size, dims, tensors, ranks, R)
    alibi = _fold_alibi(info, alibi_slopes, in_dims[13], R)
    out, lse = attention_forward(q, k, v, m, dropout_p, is_causal, scale, enable_gqa, None,
                                 *variants, alibi, None)
    logical = _out_shape(*(torch.empty(s, device="meta") for s in shapes[:3]), enable_gqa)
    B = info.batch_size
    return (out.reshape(B, *logical), lse.reshape(B, *logical[:-1])), (0, 0)


def _backward_vmap(info, in_dims, grad_out, query, key, value, out, lse, attn_mask, dropout_p,
                   is_causal, scale, enable_gqa, seed, mask_grad, window_left=None,
                   window_right=None, alignment="top_left", softcap=None, alibi_slopes=None,
                   sinks=None):
    variants = (window_left, window_right, alignment, softcap)
    args = (grad_out, query, key, value, out, lse, attn_mask, dropout_p, is_causal, scale,
            enable_gqa, seed, mask_grad, *variants, alibi_slopes, sinks)
    in_dims = _all_dims(in_dims, args)
    if dropout_p > 0 or sinks is not None:  # sinks: per-index gradients, as in the forward
        return _vmap_loop(attention_backward, info, in_dims, args)
    tensors = (grad_out, query, key, value, out, lse, attn_mask)
    dims = in_dims[:7]
    shapes = [_logical(t, d) for t, d in zip(tensors, dims)]
    ranks = [None if s is None else len(s) for s in shapes]
    R = max(max(r for r in ranks if r is not None), 3)
    # lse has one dim less than out: pad it as out is padded (one more logical dim)
    ranks[5] += 1
    folded = _fold(info.batch_size, dims, tensors, ranks, R)
    alibi = _fold_alibi(info, alibi_slopes, in_dims[17], R)
    dq, dk, dv, dm, ds = attention_backward(*folded, dropout_p, is_causal, scale, enable_gqa,
                                            None, mask_grad, *variants, alibi, None)
    B = info.batch_size
    grads = [g.reshape(B, *s) for g, s in zip((dq, dk, dv), shapes[1:4])]
    if mask_grad:
        return (*grads, dm.reshape(B, *shapes[6]), ds), (0, 0, 0, 0, None)
    return (*grads, dm, ds), (0, 0, 0, None, None)


if hasattr(attention_forward, "register_vmap"):  # torch >= 2.5
    attention_forward.register_vmap(_forward_vmap)
    attention_backward.register_vmap(_backward_vmap)


# ---------------------------------------------------------------- serving operators


def _index(t, name):
    """An integer argument of the serving op (``cache_seqlens``, ``block_table``,
    ``cache_leftpad``) for the NumPy-level API: a NumPy view of a CPU tensor, a CUDA tensor as
    is (the API reads these on the host), None for None."""
    if t is None:
        return None
    _check_index(t, name)
    t = t.detach()
    return t.numpy() if t.device.type == "cpu" else t


def _check_index(t, name):
    """TypeError unless ``t`` is an integer tensor."""
    if not isinstance(t, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool:
        raise TypeError(f"{name} must be an integer tensor, got dtype {t.dtype}")


def _kvcache_variants(window_left, window_right, alignment, softcap, alibi_slopes, sinks):
    """The NumPy-level keywords of the variants the serving op was given (those left at None
    are not passed, so the API's defaults and its errors for what it lacks apply)."""
    return {k: x for k, x in _variants(window_left, window_right, alignment, softcap,
                                       alibi_slopes, sinks).items() if x is not None}


def _kvcache_forward(q, k_cache, v_cache, cache_seqlens, k, v, block_table, cache_leftpad,
                     is_causal, scale, window_left, window_right, alignment, softcap,
                     alibi_slopes, sinks):
    """The body of both KV-cache operators: :func:`sdpa_numba.attention_with_kvcache` on
    NumPy views (or CUDA tensors), ``(out, lse)`` as tensors. Variants left at None are not
    passed (the API's defaults apply)."""
    variants = _kvcache_variants(window_left, window_right, alignment, softcap, alibi_slopes,
                                 sinks)
    if cache_leftpad is not None:
        variants["cache_leftpad"] = _index(cache_leftpad, "cache_leftpad")
    out, lse = _kvcache(_operand(q, "q"), _operand(k_cache, "k_cache"),
                        _operand(v_cache, "v_cache"), _index(cache_seqlens, "cache_seqlens"),
                        k=_operand(k, "k"), v=_operand(v, "v"),
                        block_table=_index(block_table, "block_table"), is_causal=is_causal,
                        scale=scale, return_lse=True, **variants)
    return _tensor(out), _tensor(lse)


@torch.library.custom_op("sdpa_numba::attention_with_kvcache",
                         mutates_args=("k_cache", "v_cache"))
def attention_with_kvcache_op(q: Tensor, k_cache: Tensor, v_cache: Tensor,
                              cache_seqlens: Tensor, k: Optional[Tensor] = None,
                              v: Optional[Tensor] = None, block_table: Optional[Tensor] = None,
                              cache_leftpad: Optional[Tensor] = None, is_causal: bool = True,
                              scale: Optional[float] = None, window_left: Optional[int] = None,
                              window_right: Optional[int] = None,
                              alignment: Optional[str] = None, softcap: Optional[float] = None,
                              alibi_slopes: Optional[Tensor] = None,
                              sinks: Optional[Tensor] = None) -> Tuple[Tensor, Tensor]:
    """``(out, lse)`` of :func:`sdpa_numba.attention_with_kvcache` (``out`` ``(B, Lq, Hq,
    Ev)``, ``lse`` ``(B, Hq, Lq)`` in the compute dtype). Writes ``k`` and ``v`` into the
    caches when given (the caches are the op's mutated arguments). No autograd: an inference
    operator. Variants left at None are not passed (the API's defaults apply).

    No vmap (NotImplementedError): the append writes the caches in place, and under vmap
    a batched cache folded into the batch dim is in general a copy (the write would be
    lost), while an unbatched cache would take every index's write at the same place.
    Append outside vmap and vmap the read-only :func:`attention_with_kvcache_read_op`."""
    return _kvcache_forward(q, k_cache, v_cache, cache_seqlens, k, v, block_table,
                            cache_leftpad, is_causal, scale, window_left, window_right,
                            alignment, softcap, alibi_slopes, sinks)


@torch.library.custom_op("sdpa_numba::attention_with_kvcache_read", mutates_args=())
def attention_with_kvcache_read_op(q: Tensor, k_cache: Tensor, v_cache: Tensor,
                                   cache_seqlens: Tensor, block_table: Optional[Tensor] = None,
                                   cache_leftpad: Optional[Tensor] = None,
                                   is_causal: bool = True, scale: Optional[float] = None,
                                   window_left: Optional[int] = None,
                                   window_right: Optional[int] = None,
                                   alignment: Optional[str] = None,
                                   softcap: Optional[float] = None,
                                   alibi_slopes: Optional[Tensor] = None,
                                   sinks: Optional[Tensor] = None) -> Tuple[Tensor, Tensor]:
    """:func:`attention_with_kvcache_op` without the append (no ``k``, ``v``): it only reads
    the caches, so it declares no mutation. (A decode step that attends to a cache filled
    elsewhere, as transformers' are, takes this one: torch 2.13 dispatches a custom operator
    that declares mutated arguments through a Python kernel that costs ~0.1-0.2 ms a call
    with this many arguments, as much as the decode kernel itself on a short cache.)"""
    return _kvcache_forward(q, k_cache, v_cache, cache_seqlens, None, None, block_table,
                            cache_leftpad, is_causal, scale, window_left, window_right,
                            alignment, softcap, alibi_slopes, sinks)


def _kvcache_fake(q, k_cache, v_cache, *args, **kwargs):
    B, Lq, Hq, _ = q.shape
    return (q.new_empty((B, Lq, Hq, v_cache.shape[-1])),
            q.new_empty((B, Hq, Lq), dtype=_lse_dtype(q.dtype)))


attention_with_kvcache_op.register_fake(_kvcache_fake)
attention_with_kvcache_read_op.register_fake(_kvcache_fake)


def _flat(info, t, d):
    """``t`` with the vmapped dim folded into its first (batch) dim: ``(N * B, ...)``."""
    return None if t is None else _leading(info.batch_size, t, d).flatten(0, 1)


def _kvcache_read_vmap(info, in_dims, q, k_cache, v_cache, cache_seqlens, block_table=None,
                       cache_leftpad=None, is_causal=True, scale=None, window_left=None,
                       window_right=None, alignment=None, softcap=None, alibi_slopes=None,
                       sinks=None):
    """The read-only KV-cache op under vmap: the vmapped dim folds into the batch dim (a
    paged cache's pages too, the block table offset to each index's pages); batched sinks
    ``(Hq,)`` cannot fold, so one call per index."""
    variants = (window_left, window_right, alignment, softcap)
    args = (q, k_cache, v_cache, cache_seqlens, block_table, cache_leftpad, is_causal, scale,
            *variants, alibi_slopes, sinks)
    in_dims = _all_dims(in_dims, args)
    if in_dims[13] is not None:
        return _vmap_loop(attention_with_kvcache_read_op, info, in_dims, args)
    N = info.batch_size
    qf = _flat(info, q, in_dims[0])
    B, hq = qf.shape[0] // N, qf.shape[2]
    if block_table is None or in_dims[1] is not None or in_dims[2] is not None:
        kc, vc = _flat(info, k_cache, in_dims[1]), _flat(info, v_cache, in_dims[2])
    else:  # unbatched pages: every index reads the same pages through its block table
        kc, vc = k_cache, v_cache
    if block_table is not None:
        table = _leading(N, block_table, in_dims[4])
        if kc is not k_cache:  # index n's pages follow the pages of indices 0 .. n - 1
            pages = kc.shape[0] // N
            first = torch.arange(N, device=table.device, dtype=table.dtype) * pages
            table = table + first[:, None, None]
        block_table = table.flatten(0, 1)
    if alibi_slopes is not None and (in_dims[12] is not None or alibi_slopes.dim() == 2):
        alibi_slopes = (_leading(N, alibi_slopes, in_dims[12]).reshape(N, -1, hq)
                        .expand(N, B, hq).flatten(0, 1))
    out, lse = attention_with_kvcache_read_op(
        qf, kc, vc, _flat(info, cache_seqlens, in_dims[3]), block_table,
        _flat(info, cache_leftpad, in_dims[5]), is_causal, scale, *variants, alibi_slopes,
        sinks)
    return (out.unflatten(0, (N, B)), lse.unflatten(0, (N, B))), (0, 0)


NO_VMAP = (
    "sdpa_numba.torch.attention_with_kvcache: torch.vmap over the appending operator "
    "(torch.ops.sdpa_numba.attention_with_kvcache) is not supported: it writes k and v into "
    "the caches in place, and a batched cache folded into one batch is in general a copy "
    "(the write would be lost) while an unbatched one would take every index's write at the "
    "same place. Append outside vmap (k_cache[b, n] = k), then vmap the read-only form "
    "(attention_with_kvcache without k and v)")


def _kvcache_vmap(info, in_dims, *args, **kwargs):
    raise NotImplementedError(NO_VMAP)


def _merge_vmap(info, in_dims, out_a, lse_a, out_b=None, lse_b=None):
    """The merge under vmap: the vmapped dim becomes the first leading dim (after the parts'
    dim in the n-ary form); the merge is elementwise over leading dims."""
    args = (out_a, lse_a, out_b, lse_b)
    in_dims = _all_dims(in_dims, args)
    at = 0 if out_b is not None else 1
    out, lse = merge_attention_states_op(*(_leading(info.batch_size, t, d, at)
                                           for t, d in zip(args, in_dims)))
    return (out, lse), (0, 0)


def _lse_operand(t, name):
    """An lse argument of the merge: any float tensor (the API converts it to the compute
    dtype), as a NumPy view or CUDA tensor."""
    if not isinstance(t, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if not t.dtype.is_floating_point:
        raise TypeError(f"{name} must be a float tensor (log-sum-exp values), got dtype "
                        f"{t.dtype}")
    if t.dtype in (torch.float16, torch.bfloat16):  # per-row numbers: a copy is nothing
        t = t.float()
    return _operand(t, name)


@torch.library.custom_op("sdpa_numba::merge_attention_states", mutates_args=())
def merge_attention_states_op(out_a: Tensor, lse_a: Tensor, out_b: Optional[Tensor] = None,
                              lse_b: Optional[Tensor] = None) -> Tuple[Tensor, Tensor]:
    """``(out, lse)`` of :func:`sdpa_numba.merge_attention_states`: two parts ``(out_a,
    lse_a, out_b, lse_b)``, or ``n`` stacked parts ``(outs, lses)`` with ``out_b`` and
    ``lse_b`` None."""
    states = [_operand(out_a, "out_a"), _lse_operand(lse_a, "lse_a")]
    if out_b is not None or lse_b is not None:
        states += [_operand(out_b, "out_b"), _lse_operand(lse_b, "lse_b")]
    out, lse = _merge(*states)
    return _tensor(out), _tensor(lse)


@merge_attention_states_op.register_fake
def _(out_a, lse_a, out_b=None, lse_b=None):
    shape = out_a.shape if out_b is not None else out_a.shape[1:]
    return (out_a.new_empty(shape), out_a.new_empty(shape[:-1],
                                                    dtype=_lse_dtype(out_a.dtype)))


def _merge_setup_context(ctx, inputs, output):
    out_a, lse_a, out_b, lse_b = tuple(inputs) + (None, None)[:4 - len(inputs)]
    out, lse = output
    ctx.two = out_b is not None
    ctx.save_for_backward(out_a, lse_a, out_b, lse_b, out, lse)


def _merge_backward(ctx, grad_out, grad_lse):
    """The merge's gradients in torch operations: with ``w_i = exp(lse_i - lse)`` (0 for a
    part without keys), ``d out_i = w_i g`` and ``d lse_i = w_i (glse + g . (out_i - out))``."""
    out_a, lse_a, out_b, lse_b, out, lse = ctx.saved_tensors
    outs = torch.stack((out_a, out_b)) if ctx.two else out_a
    lses = torch.stack((lse_a, lse_b)) if ctx.two else lse_a
    ct = lse.dtype
    w = torch.where(torch.isneginf(lses), torch.zeros((), dtype=ct, device=lse.device),
                    torch.exp(lses.to(ct) - lse))
    g = torch.zeros_like(out, dtype=ct) if grad_out is None else grad_out.to(ct)
    gl = torch.zeros_like(lse) if grad_lse is None else grad_lse.to(ct)
    d_outs = (w[..., None] * g).to(outs.dtype)
    d_lses = (w * (gl + (g * (outs.to(ct) - out.to(ct))).sum(-1))).to(lses.dtype)
    if ctx.two:
        return d_outs[0], d_lses[0], d_outs[1], d_lses[1]
    return d_outs, d_lses, None, None


merge_attention_states_op.register_autograd(_merge_backward,
                                            setup_context=_merge_setup_context)

if hasattr(attention_forward, "register_vmap"):  # torch >= 2.5
    attention_with_kvcache_read_op.register_vmap(_kvcache_read_vmap)
    attention_with_kvcache_op.register_vmap(_kvcache_vmap)
    merge_attention_states_op.register_vmap(_merge_vmap)


# ---------------------------------------------------------------- varlen operators


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
    out, lse = _varlen(_operand(q, "q"), _operand(k, "k"), _operand(v, "v"),
                       _index(cu_seqlens_q, "cu_seqlens_q"), _index(cu_seqlens_k, "cu_seqlens_k"),
                       max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k,
                       is_causal=is_causal, scale=scale, dropout_p=dropout_p, seed=_seed(seed),
                       return_lse=True,
                       **_variants(window_left, window_right, alignment, softcap, alibi_slopes,
                                   sinks))
    return _tensor(out), _tensor(lse)


@varlen_attention_forward.register_fake
def _(q, k, v, cu_seqlens_q, cu_seqlens_k, *args, **kwargs):
    # the shapes depend on the inputs' shapes only (symbolic under torch.compile)
    total_q, hq = q.shape[:2]
    return (q.new_empty((total_q, hq, v.shape[-1])),
            q.new_empty((hq, total_q), dtype=_lse_dtype(q.dtype)))


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
    grads = _varlen_backward(_operand(grad_out, "grad_out"), _operand(q, "q"),
                             _operand(k, "k"), _operand(v, "v"), _operand(out, "out"),
                             _operand(lse, "lse"), _index(cu_seqlens_q, "cu_seqlens_q"),
                             _index(cu_seqlens_k, "cu_seqlens_k"), is_causal=is_causal,
                             scale=scale, dropout_p=dropout_p, seed=_seed(seed),
                             **_variants(window_left, window_right, alignment, softcap,
                                         alibi_slopes, sinks))
    dq, dk, dv = (_tensor(g) for g in grads[:3])
    return dq, dk, dv, _sinks_grad(grads, sinks, q)


@varlen_attention_backward.register_fake
def _(grad_out, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, dropout_p, is_causal, scale,
      seed, window_left=None, window_right=None, alignment="top_left", softcap=None,
      alibi_slopes=None, sinks=None):
    return (q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape),
            sinks.new_empty(sinks.shape) if sinks is not None else q.new_empty(0))


_VARLEN_ARGS = 11  # the varlen forward's arguments before its variants
_VARLEN_SINKS = _VARLEN_ARGS + 5


def _varlen_setup_context(ctx, inputs, output):
    ctx.n_inputs = len(inputs)
    (q, k, v, cu_q, cu_k, _, _, dropout_p, is_causal, scale, seed, window_left, window_right,
     alignment, softcap, alibi_slopes, sinks) = (
        tuple(inputs) + _DEFAULTS[len(inputs) - _VARLEN_ARGS:])
    out, lse = output
    ctx.mark_non_differentiable(lse)
    ctx.save_for_backward(q, k, v, out, lse, cu_q, cu_k, seed, alibi_slopes, sinks)
    ctx.args = (dropout_p, is_causal, scale)
    ctx.variants = (window_left, window_right, alignment, softcap)


def _varlen_double_backward(ctx, grad_out, q, k, v, cu_q, cu_k, seed, alibi_slopes, sinks):
    """Differentiable first-order gradients (``create_graph=True``), as the dense op's
    :func:`_double_backward`: :func:`_dense_attention` per sequence (the dense stream of
    the sequence's index for dropout), O(L x S) memory per sequence, only on this path."""
    dropout_p, is_causal, scale = ctx.args
    need = list(ctx.needs_input_grad[:3]) + [_needs_sinks_grad(ctx, sinks, _VARLEN_SINKS)]
    inputs = [None if t is None else t.view_as(t) for t in (q, k, v, sinks)]
    cq, ck = cu_q.tolist(), cu_k.tolist()
    outs = []
    for b in range(len(cq) - 1):
        qb, kb, vb = (x[c[b]:c[b + 1]].transpose(0, 1)
                      for x, c in zip(inputs[:3], (cq, ck, ck)))
        if kb.shape[1] == 0 or qb.shape[1] == 0:  # no keys: zeros (and no scores to reduce)
            outs.append(q.new_zeros((qb.shape[1], qb.shape[0], v.shape[-1])))
            continue
        slopes = alibi_slopes
        if slopes is not None and slopes.dim() == 2:  # (B, Hq): the sequence's row
            slopes = slopes[b] if slopes.shape[0] > 1 else slopes[0]
        out = _dense_attention(qb, kb, vb, None, dropout_p, is_causal, scale, True, seed,
                               *ctx.variants, alibi_slopes=slopes, sinks=inputs[3],
                               batch_index=b)
        outs.append(out.transpose(0, 1))
    return _graph_grads(ctx, torch.cat(outs), grad_out, inputs, need, _VARLEN_SINKS)


def _varlen_backward_formula(ctx, grad_out, grad_lse):
    q, k, v, out, lse, cu_q, cu_k, seed, alibi_slopes, sinks = ctx.saved_tensors
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad
                                       for t in (grad_out, q, k, v, sinks)):
        return _varlen_double_backward(ctx, grad_out, q, k, v, cu_q, cu_k, seed, alibi_slopes,
                                       sinks)
    dq, dk, dv, ds = varlen_attention_backward(grad_out, q, k, v, out, lse, cu_q, cu_k,
                                               *ctx.args, seed, *ctx.variants, alibi_slopes,
                                               sinks)
    need = ctx.needs_input_grad
    grads = [None] * ctx.n_inputs
    grads[:3] = (dq if need[0] else None, dk if need[1] else None, dv if need[2] else None)
    if _needs_sinks_grad(ctx, sinks, _VARLEN_SINKS):
        grads[_VARLEN_SINKS] = ds
    return tuple(grads)


varlen_attention_forward.register_autograd(_varlen_backward_formula,
                                           setup_context=_varlen_setup_context)
varlen_attention_backward.register_autograd(
    _no_double_backward("varlen_attention_backward", "varlen_attention"),
    setup_context=_setup_nothing)


# ---------------------------------------------------------------- the function

FUNC_GRAD = (
    "sdpa_numba.torch: torch.func.grad, vjp, jacrev, jvp and hessian are not supported over "
    "this operator (torch's custom operators with autograd do not support torch.func's "
    "autodiff transforms): use torch.autograd.grad / .backward(); torch.vmap works")


def _check_no_func_grad(*tensors):
    """A clear error inside torch.func's autodiff transforms, instead of torch's message about
    an autograd.Function's setup_context that the user never wrote."""
    is_wrapped = getattr(torch._C._functorch, "is_gradtrackingtensor", None)
    if is_wrapped is not None and any(t is not None and is_wrapped(t) for t in tensors):
        raise NotImplementedError(FUNC_GRAD)



NUMBA_LEVEL = (
    "sdpa_numba.torch.{func}: {names} cannot cross a PyTorch operator's schema (they are Numba "
    "functions and objects, not tensors or numbers): use the NumPy-level sdpa_numba.{func} / "
    "{func}_backward (which take them with NumPy arrays, and CUDA arrays: torch CUDA tensors "
    "included)")


def _check_schema_arguments(func, tensors, optional, window, score_mod, mask_mod, mod_args,
                            score_mod_grad, block_mask):
    """The public wrappers' checks, before the operator is called (and traced): the
    Numba-level variants refused (NotImplementedError naming them and ``func``'s NumPy-level
    twin), ``tensors`` (name, tensor) required, ``optional`` ones tensors or None (a bool
    ``attn_mask`` allowed), the window's sides returned. Outside torch.compile, torch.func's
    autodiff transforms are refused."""
    numba_level = [name for name, x in (("score_mod", score_mod), ("mask_mod", mask_mod),
                                        ("score_mod_grad", score_mod_grad),
                                        ("block_mask", block_mask)) if x is not None]
    if mod_args != () and mod_args is not None:
        numba_level.append("mod_args")
    if numba_level:
        raise NotImplementedError(NUMBA_LEVEL.format(func=func, names=", ".join(numba_level)))
    for name, t in tensors:
        if t is None:
            raise TypeError(f"{name} must be a torch.Tensor, got None")
        _check_tensor(t, name)
    for name, t in optional:
        _check_tensor(t, name, mask=name == "attn_mask")
    if not torch.compiler.is_compiling():
        _check_no_func_grad(*(t for _, t in tensors + optional))
    return _check_window(window)


def _check_window(window):
    """``window`` as the op's two sides, with the NumPy-level API's errors."""
    from ..problem.variants import check_window

    check_window(window)  # TypeError / ValueError naming the argument
    if window is None:
        return None, None
    return tuple(None if x is None else int(x) for x in window)


def scaled_dot_product_attention(query, key, value, attn_mask=None, dropout_p=0.0,
                                 is_causal=False, scale=None, enable_gqa=False, *, seed=None,
                                 window=None, alignment="top_left", softcap=None,
                                 alibi_slopes=None, sinks=None, score_mod=None, mask_mod=None,
                                 mod_args=(), score_mod_grad=None, block_mask=None):
    """``torch.nn.functional.scaled_dot_product_attention`` on sdpa_numba's CPU or CUDA
    kernels, as a PyTorch operator: autograd (gradients for query, key, value and a float
    ``attn_mask``), ``torch.compile`` (no graph break), ``vmap``, meta tensors.

    Same arguments and semantics as torch's (``dropout_p`` applies whenever it is > 0, as in
    torch's functional form: pass 0 in evaluation). ``seed`` (an int in ``[0, 2**64)``) fixes
    the dropout mask (see :mod:`sdpa_numba.dropout`: the same seed gives the mask that
    :func:`sdpa_numba.scaled_dot_product_attention` draws); None draws one from torch's
    generator, and the backward replays that mask. CPU tensors run on the CPU kernels, CUDA
    tensors on the CUDA kernels; float16, bfloat16 (needs ml_dtypes), float32, float64; 16-bit
    inputs compute in float32. Double backward works: with ``create_graph=True`` the gradients
    are taken through torch operations (L x S memory) so that they have second-order terms.

    The variants of :func:`sdpa_numba.scaled_dot_product_attention` that fit an operator
    schema, keyword-only, same semantics:

    * ``window=(left, right)``: query ``i`` sees keys ``i' - left <= j <= i' + right``
      (``None`` on a side: unlimited), ``i' = i`` or, with ``alignment="bottom_right"``,
      ``i + S - L`` (which also moves ``is_causal`` and ALiBi's diagonal);
    * ``softcap=c``: scores ``c * tanh(s / c)`` (differentiable);
    * ``alibi_slopes``: a tensor ``(Hq,)`` or ``(*batch, Hq)``; adds ``-slope * |i' - j|``
      (no gradient for the slopes: they are constants in every model that uses them);
    * ``sinks``: a tensor ``(Hq,)``, one logit per head in every row's softmax denominator
      (gpt-oss's attention sinks); differentiable: autograd gives its gradient.

    16-bit slopes or sinks are read in float32. ``score_mod``, ``mask_mod``, ``mod_args``,
    ``score_mod_grad`` and ``block_mask`` raise NotImplementedError: Numba functions cannot
    cross an operator's schema; the NumPy-level API takes them.
    """
    window_left, window_right = _check_schema_arguments(
        "scaled_dot_product_attention", [("query", query), ("key", key), ("value", value)],
        [("attn_mask", attn_mask), ("alibi_slopes", alibi_slopes), ("sinks", sinks)], window,
        score_mod, mask_mod, mod_args, score_mod_grad, block_mask)
    out, _ = attention_forward(query, key, value, attn_mask, dropout_p, is_causal, scale,
                               enable_gqa, _seed_tensor(seed, dropout_p), window_left,
                               window_right, alignment, softcap, alibi_slopes, sinks)
    return out


def varlen_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, *, max_seqlen_q=None,
                     max_seqlen_k=None, dropout_p=0.0, is_causal=False, scale=None, seed=None,
                     return_lse=False, window=None, alignment="top_left", softcap=None,
                     alibi_slopes=None, sinks=None, score_mod=None, mask_mod=None,
                     mod_args=(), score_mod_grad=None, block_mask=None):
    """:func:`sdpa_numba.varlen_attention` on torch tensors (FlashAttention's
    ``flash_attn_varlen_func`` layout), as the PyTorch operator
    ``torch.ops.sdpa_numba.varlen_attention_forward``: autograd (gradients for q, k, v and
    the sinks; double backward through torch operations, per sequence), ``torch.compile``
    (no graph break), meta tensors.

    Parameters
    ----------
    q : torch.Tensor, shape (total_q, Hq, E)
        A ragged batch packed back to back; float16, bfloat16 (needs ml_dtypes), float32 or
        float64; CPU or CUDA.
    k, v : torch.Tensor, shape (total_k, H, E) / (total_k, H, Ev)
        ``Hq`` a multiple of ``H`` (grouped-query attention).
    cu_seqlens_q, cu_seqlens_k : torch.Tensor of int32 or int64, shape (B + 1,)
        Cumulative sequence lengths (read on the host); sequences of length 0 are allowed.
    max_seqlen_q, max_seqlen_k : int, optional
        FlashAttention's hints: checked to be at least the longest sequence if given.
    dropout_p, is_causal, scale, seed
        As in :func:`scaled_dot_product_attention`: ``seed`` None draws one from torch's
        generator; sequence ``b`` gets the dense stream of batch entry ``b``.
    return_lse : bool
        Also return the log-sum-exp ``(Hq, total_q)`` in the compute dtype (no gradient).
    window, alignment, softcap, alibi_slopes, sinks
        The variants, as in :func:`scaled_dot_product_attention`, per sequence (rows and keys
        counted from the sequence's first; ``alibi_slopes`` ``(Hq,)`` or ``(B, Hq)``).
    score_mod, mask_mod, mod_args, score_mod_grad, block_mask
        Refused (NotImplementedError): Numba functions cannot cross an operator's schema;
        the NumPy-level :func:`sdpa_numba.varlen_attention` takes them.

    Returns
    -------
    out : torch.Tensor, shape (total_q, Hq, Ev), q's dtype, contiguous
    lse : torch.Tensor, shape (Hq, total_q), only with ``return_lse=True``

    Raises
    ------
    TypeError, ValueError
        Bad input, naming the argument (cu_seqlens' values are checked by the NumPy-level
        API when the operator runs).
    """
    window_left, window_right = _check_schema_arguments(
        "varlen_attention", [("q", q), ("k", k), ("v", v)],
        [("alibi_slopes", alibi_slopes), ("sinks", sinks)], window, score_mod, mask_mod,
        mod_args, score_mod_grad, block_mask)
    _check_index(cu_seqlens_q, "cu_seqlens_q")
    _check_index(cu_seqlens_k, "cu_seqlens_k")
    out, lse = varlen_attention_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                        max_seqlen_k, dropout_p, is_causal, scale,
                                        _seed_tensor(seed, dropout_p), window_left,
                                        window_right, alignment, softcap, alibi_slopes, sinks)
    return (out, lse) if return_lse else out


NO_BACKWARD = (
    "sdpa_numba.torch.attention_with_kvcache is an inference operator (it writes the cache and "
    "has no backward): {names} require(s) grad with grad mode on; call it under "
    "torch.no_grad() / torch.inference_mode(), or use sdpa_numba.torch."
    "scaled_dot_product_attention on the cache's contents when gradients are wanted")


def _eager_cpu(*tensors):
    """Whether a call on these tensors (None: absent) would run the operator's CPU kernel
    eagerly: not under ``torch.compile`` or a dispatch mode (fake tensors, ``make_fx``), and
    every tensor a plain CPU tensor, not one wrapped by a torch.func transform (``vmap``'s
    batched tensors have no storage and need the operator's vmap rule). Then the operator's
    body may be called directly."""
    if torch.compiler.is_compiling() or _dispatch_mode() is not None:
        return False
    wrapped = torch._C._functorch.is_functorch_wrapped_tensor
    return all(t is None or (type(t) is Tensor and t.device.type == "cpu" and not wrapped(t))
               for t in tensors)


def _dispatch_mode():
    from torch.utils._python_dispatch import _get_current_dispatch_mode

    return _get_current_dispatch_mode()


def attention_with_kvcache(q, k_cache, v_cache, cache_seqlens, *, k=None, v=None,
                           block_table=None, cache_leftpad=None, is_causal=True, scale=None,
                           return_lse=False, window=None, alignment=None, softcap=None,
                           alibi_slopes=None, sinks=None):
    """:func:`sdpa_numba.attention_with_kvcache` on torch tensors, as the PyTorch operator
    ``torch.ops.sdpa_numba.attention_with_kvcache`` (``torch.compile`` traces it with no graph
    break; meta tensors get shapes), or without ``k`` and ``v`` as
    ``torch.ops.sdpa_numba.attention_with_kvcache_read``, which only reads the caches.

    New query tokens against a key/value cache, contiguous or paged (FlashAttention's
    ``flash_attn_with_kvcache`` layouts), with an optional in-place append of ``k`` and ``v``
    into the caches: the one documented write to an input (the operator declares the caches
    mutated, so torch.compile keeps the write).

    Parameters
    ----------
    q : torch.Tensor, shape (B, Lq, Hq, E)
        float16, bfloat16 (needs ml_dtypes), float32 or float64; CPU or CUDA.
    k_cache, v_cache : torch.Tensor, shape (B, S_max, H, E) / (B, S_max, H, Ev)
        Or ``(num_pages, page_size, H, ·)`` with ``block_table``. q's dtype and device; any
        strides with the last dim contiguous (``key.transpose(1, 2)`` of a ``(B, H, S, E)``
        tensor is taken without a copy).
    cache_seqlens : int or torch.Tensor of ints, shape (B,)
        Keys already in the cache per sequence (read on the host).
    k, v : torch.Tensor, optional
        New keys and values ``(B, Lq_new, H, ·)``, written into the caches first.
    block_table : torch.Tensor of int32, shape (B, max_pages), optional
        A paged cache's page table.
    cache_leftpad : torch.Tensor of ints, shape (B,), optional
        Where each sequence's keys start in its cache (left padding; passed to the NumPy-level
        API, which says whether it takes it).
    is_causal : bool
        Bottom-right aligned causality (default True): query token ``t`` sees the cache and
        the new tokens up to its own position; False: every key.
    scale : float, optional
        Default ``1 / sqrt(E)``.
    return_lse : bool
        Also return the log-sum-exp ``(B, Hq, Lq)`` in the compute dtype.
    window, alignment, softcap, alibi_slopes, sinks
        The variants, spelled as in :func:`scaled_dot_product_attention`; passed to the
        NumPy-level API only when given (None: its defaults), which raises
        NotImplementedError for those it does not take.

    Returns
    -------
    out : torch.Tensor, shape (B, Lq, Hq, Ev), q's dtype, contiguous
    lse : torch.Tensor, shape (B, Hq, Lq), only with ``return_lse=True``

    Raises
    ------
    TypeError, ValueError
        Bad input, naming the argument, before the cache is written.
    NotImplementedError
        When gradients are wanted (grad mode on and an input requires grad): the operator
        has no backward. (Called directly, ``torch.ops.sdpa_numba.attention_with_kvcache``
        registers no autograd; differentiating through it raises torch's "no autograd
        formula" error.) Also under ``torch.vmap`` with ``k`` and ``v`` (an in-place append
        cannot be vmapped: see :func:`attention_with_kvcache_op`); without them, vmap works
        (the vmapped dim joins the batch dim).
    """
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        if t is None:
            raise TypeError(f"{name} must be a torch.Tensor, got None")
        _check_tensor(t, name)
    for name, t in (("k", k), ("v", v), ("alibi_slopes", alibi_slopes), ("sinks", sinks)):
        _check_tensor(t, name)
    if torch.is_grad_enabled():
        wanting = [name for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache),
                                        ("k", k), ("v", v), ("alibi_slopes", alibi_slopes),
                                        ("sinks", sinks))
                   if t is not None and t.requires_grad]
        if wanting:
            raise NotImplementedError(NO_BACKWARD.format(names=", ".join(wanting)))
    if isinstance(cache_seqlens, int) and not isinstance(cache_seqlens, bool):
        if q.dim() < 1:
            raise ValueError(f"q must have 4 dims (B, Lq, Hq, E), got shape {tuple(q.shape)}")
        cache_seqlens = torch.full((q.shape[0],), cache_seqlens, dtype=torch.int64)
    window_left, window_right = _check_window(window)
    variants = (window_left, window_right, alignment, softcap, alibi_slopes, sinks)
    if _eager_cpu(q, k_cache, v_cache, cache_seqlens, k, v, block_table, cache_leftpad,
                  alibi_slopes, sinks):
        # No tracing, no fake tensors, no dispatch mode: the operator's body itself. Through
        # torch's dispatcher a call costs ~0.1 ms more, as much as a decode step of a small
        # model's layer.
        out, lse = _kvcache_forward(q, k_cache, v_cache, cache_seqlens, k, v, block_table,
                                    cache_leftpad, is_causal, scale, *variants)
    elif k is None and v is None:  # nothing to append: the operator that declares no mutation
        out, lse = attention_with_kvcache_read_op(q, k_cache, v_cache, cache_seqlens,
                                                  block_table, cache_leftpad, is_causal, scale,
                                                  *variants)
    else:
        out, lse = attention_with_kvcache_op(q, k_cache, v_cache, cache_seqlens, k, v,
                                             block_table, cache_leftpad, is_causal, scale,
                                             *variants)
    return (out, lse) if return_lse else out


def merge_attention_states(out_a, lse_a, out_b=None, lse_b=None):
    """:func:`sdpa_numba.merge_attention_states` on torch tensors, as the PyTorch operator
    ``torch.ops.sdpa_numba.merge_attention_states``, with autograd (the gradients of both
    results, in torch operations) and ``torch.compile`` support.

    Parameters
    ----------
    out_a, lse_a, out_b, lse_b : torch.Tensor
        Two parts: normalized attention outputs ``(..., Ev)`` over disjoint key sets and their
        log-sum-exp ``(...)``. Or the n-ary form ``merge_attention_states(outs, lses)``:
        ``outs (n, ..., Ev)`` and ``lses (n, ...)`` (lists or tuples of tensors are stacked
        first).

    Returns
    -------
    out : torch.Tensor, shape (..., Ev), the outputs' dtype
    lse : torch.Tensor, shape (...), the compute dtype

    Raises
    ------
    TypeError, ValueError
        Bad input, naming the argument.
    """
    if (out_b is None) != (lse_b is None):
        raise TypeError("merge_attention_states takes (out_a, lse_a, out_b, lse_b) or "
                        "(outs, lses): out_b and lse_b go together")
    if out_b is None:
        out_a, lse_a = (torch.stack(list(x)) if isinstance(x, (list, tuple)) else x
                        for x in (out_a, lse_a))
    if out_a is None:
        raise TypeError("out_a must be a torch.Tensor, got None")
    _check_tensor(out_a, "out_a")
    _check_tensor(out_b, "out_b")
    for name, t in (("lse_a", lse_a), ("lse_b", lse_b)):
        if t is not None and not isinstance(t, Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    return merge_attention_states_op(out_a, lse_a, out_b, lse_b)


class SDPAFunction:
    """Deprecated: earlier versions' ``torch.autograd.Function``. ``SDPAFunction.apply(query,
    key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, seed)`` still works: it
    calls :func:`scaled_dot_product_attention`, with a DeprecationWarning."""

    @staticmethod
    def apply(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
              enable_gqa=False, seed=None):
        warnings.warn("sdpa_numba.torch.SDPAFunction is deprecated: call "
                      "sdpa_numba.torch.scaled_dot_product_attention", DeprecationWarning,
                      stacklevel=2)
        return scaled_dot_product_attention(query, key, value, attn_mask, dropout_p, is_causal,
                                            scale, enable_gqa, seed=seed)
