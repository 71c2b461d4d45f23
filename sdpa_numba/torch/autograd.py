"""Autograd of the operators: the dense and varlen forwards' backward formulas (the
backward operators; under ``create_graph=True`` the same attention written in torch
operations, so that the gradients have second-order terms), the merge's gradients in torch
operations, and the backward operators' refusal of a second derivative."""

import torch

from .dense import attention_backward, attention_forward
from .serving import merge_attention_states_op
from .tensors import kernel_seed, out_shape
from .varlen import varlen_attention_backward, varlen_attention_forward

DOUBLE_BACKWARD = (
    "sdpa_numba: the operator torch.ops.sdpa_numba.{op} is not differentiable (its kernels "
    "have no derivative): differentiate sdpa_numba.torch.{func} with create_graph=True "
    "instead, which takes its second-order terms through torch")


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
            keep = keep_mask(kernel_seed(seed), dropout_p, tuple(p.shape[:-3]), p.shape[-3],
                             L, S)
        else:  # the dense stream of batch entry batch_index
            keep = keep_mask(kernel_seed(seed), dropout_p, (batch_index + 1,), p.shape[-3], L,
                             S)[batch_index]
        p = p * torch.from_numpy(keep).to(p.device) * (1.0 / (1.0 - dropout_p))
    out = (p @ v).to(dtype)
    return out.reshape(out_shape(query, key, value, enable_gqa))


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
