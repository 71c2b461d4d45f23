"""Autograd of the operators: the dense and varlen forwards' backward formulas (the
backward operators; under ``create_graph=True`` the same attention written in torch
operations, so that the gradients have second-order terms), the merge's gradients in torch
operations, and the backward operators' refusal of a second derivative."""

import torch

from ..problem.variant_table import TORCH_TENSORS, VARIANTS
from .dense import FORWARD_ARGS, GRAD_NAMES, attention_backward, attention_forward
from .serving import merge_attention_states_op
from .tensors import OP_NAMES, OP_TENSORS, kernel_seed, op_values, op_variants, out_shape
from .varlen import FORWARD_ARGS as VARLEN_ARGS
from .varlen import TAIL_ARGS as VARLEN_TAIL
from .varlen import split_tail as varlen_split_tail
from .varlen import varlen_attention_backward, varlen_attention_forward

DOUBLE_BACKWARD = (
    "sdpa_numba: the operator torch.ops.sdpa_numba.{op} is not differentiable (its kernels "
    "have no derivative): differentiate sdpa_numba.torch.{func} with create_graph=True "
    "instead, which takes its second-order terms through torch")


#: The operators' variant arguments that are tensors (saved for the backward), and the rest
#: (kept on ctx as they are).
_TENSORS = OP_TENSORS
_SCALARS = tuple(name for name in OP_NAMES if name not in OP_TENSORS)


def _save(ctx, inputs, n_own, own_tensors):
    """Save the forward's tensors ``own_tensors`` and the tensor variants; keep the other
    variants on ``ctx``; return the variants (a dict). ``inputs``: the op's arguments (torch
    fills in those left at their defaults; :func:`.tensors.op_variants` pads as a guard);
    the backward returns one gradient (or None) per input (``ctx.n_inputs``)."""
    ctx.n_inputs = len(inputs)
    variants = op_variants(inputs[n_own:])
    ctx.save_for_backward(*own_tensors, *(variants[name] for name in _TENSORS))
    ctx.n_own = len(own_tensors)
    ctx.scalars = {name: variants[name] for name in _SCALARS}
    return variants


def _restore(ctx):
    """``(own saved tensors, variants dict)``: what :func:`_save` kept."""
    saved = ctx.saved_tensors
    variants = dict(ctx.scalars)
    variants.update(zip(_TENSORS, saved[ctx.n_own:]))
    return saved[:ctx.n_own], variants


def _setup_context(ctx, inputs, output):
    (query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa,
     seed) = inputs[:len(FORWARD_ARGS)]
    out, lse = output
    ctx.mark_non_differentiable(lse)
    _save(ctx, inputs, len(FORWARD_ARGS), (query, key, value, attn_mask, out, lse, seed))
    ctx.args = (dropout_p, is_causal, scale, enable_gqa)


def _dense_attention(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa,
                     seed, variants, batch_index=None):
    """The forward in plain torch operations, building the L x S probabilities: what the
    double backward differentiates twice. Same semantics as the kernels (causal and the
    window and the chunks in the ``alignment``'s frame, the score formed as scale -> the variants that change
    it in the table's order (soft cap, ALiBi: their ``torch_score``) -> additive mask, then
    masked; sinks in every row's denominator; fully masked rows give 0; the dropout mask of
    :mod:`sdpa_numba.dropout`). ``variants``: the op's variant arguments (a dict).
    ``batch_index``: 3-D inputs that are entry ``batch_index`` of a batch (a varlen
    sequence), for the dropout stream."""
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
    offset = S - L if variants["alignment"] == "bottom_right" else 0
    rel = (torch.arange(L, device=s.device)[:, None] + offset
           - torch.arange(S, device=s.device)[None, :])
    for var in VARIANTS:
        if var.torch_score is not None and variants[var.name] is not None:
            s = var.torch_score(s, variants[var.name], rel)
    if attn_mask is not None and attn_mask.dtype != torch.bool:
        s = s + attn_mask.to(s.dtype)
    keep = torch.ones(L, S, dtype=torch.bool, device=s.device)
    right = variants["window_right"]
    if is_causal:
        right = 0 if right is None else min(right, 0)
    if variants["window_left"] is not None:
        keep &= rel <= variants["window_left"]
    if right is not None:
        keep &= -rel <= right
    if variants.get("chunk") is not None:  # the query's chunk (its aligned position's)
        c = int(variants["chunk"])
        pos = torch.arange(L, device=s.device)[:, None] + offset
        keep &= torch.div(pos, c, rounding_mode="floor") == torch.div(
            torch.arange(S, device=s.device)[None, :], c, rounding_mode="floor")
    s = s.masked_fill(~keep, -float("inf"))
    if attn_mask is not None and attn_mask.dtype == torch.bool:
        s = s.masked_fill(~attn_mask, -float("inf"))
    m = s.detach().amax(dim=-1, keepdim=True)
    sink = None
    if variants["sinks"] is not None:  # (Hq,): one logit per head, joining each denominator
        sink = variants["sinks"].to(s.dtype)[:, None, None]
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


def _grad_index(n_own, name):
    """The index of variant argument ``name`` among an op's arguments (``n_own`` its own)."""
    return n_own + OP_NAMES.index(name)


def _needs_grad(ctx, t, index):
    """Whether autograd wants the gradient of the op's argument ``index``, tensor ``t``.
    (torch 2.13's needs_input_grad can be shorter than the op's arguments, covering only those
    without defaults: then the saved tensor's requires_grad says it.)"""
    if t is None:
        return False
    if len(ctx.needs_input_grad) > index:
        return bool(ctx.needs_input_grad[index])
    return t.requires_grad


def _variant_needs(ctx, variants, n_own):
    """Per variant with a gradient (:data:`GRAD_NAMES`): whether autograd wants it."""
    return [_needs_grad(ctx, variants[name], _grad_index(n_own, name)) for name in GRAD_NAMES]


def _differentiable(variants):
    """The variants (a dict) with those that have a gradient as views, so that one tensor
    passed twice still gets one gradient each."""
    return {name: (t.view_as(t) if name in GRAD_NAMES and t is not None else t)
            for name, t in variants.items()}


def _double_backward(ctx, grad_out, query, key, value, attn_mask, seed, variants):
    """First-order gradients that are themselves differentiable (``create_graph=True``):
    torch's autograd through :func:`_dense_attention`. O(L x S) memory, only on this path."""
    dropout_p, is_causal, scale, enable_gqa = ctx.args
    need = list(ctx.needs_input_grad[:4])
    need[3] = need[3] and attn_mask is not None and attn_mask.is_floating_point()
    inputs = [None if t is None else t.view_as(t) for t in (query, key, value, attn_mask)]
    variants = _differentiable(variants)
    out = _dense_attention(*inputs, dropout_p, is_causal, scale, enable_gqa, seed, variants)
    return _graph_grads(ctx, out, grad_out, inputs, need, variants, len(FORWARD_ARGS))


def _graph_grads(ctx, out, grad_out, inputs, need, variants, n_own):
    """The gradients of ``out`` (computed from ``inputs`` and ``variants`` in torch
    operations) for the op's arguments, with a graph of their own: ``inputs`` are the
    leading differentiable arguments, ``need`` says which are wanted (zeros for an unused
    one), then the variants that have a gradient (when autograd wants them)."""
    inputs = inputs + [variants[name] for name in GRAD_NAMES]
    need = need + _variant_needs(ctx, variants, n_own)
    wanted = [t for t, n in zip(inputs, need) if n]
    grads = iter(torch.autograd.grad(out, wanted, grad_out, create_graph=True,
                                     allow_unused=True))
    result = [next(grads) if n else None for n in need]
    result = [torch.zeros_like(t) if n and g is None else g
              for t, n, g in zip(inputs, need, result)]
    n_lead = len(inputs) - len(GRAD_NAMES)
    grads = [None] * ctx.n_inputs
    grads[:n_lead] = result[:n_lead]
    for name, g in zip(GRAD_NAMES, result[n_lead:]):
        if g is not None:
            grads[_grad_index(n_own, name)] = g
    return tuple(grads)


def _set_variant_grads(ctx, grads, variants, dvariants, n_own):
    """Put the kernels' variant gradients ``dvariants`` (one per :data:`GRAD_NAMES`) where
    autograd wants them among ``grads``."""
    for name, need, g in zip(GRAD_NAMES, _variant_needs(ctx, variants, n_own), dvariants):
        if need:
            grads[_grad_index(n_own, name)] = g


def _backward_formula(ctx, grad_out, grad_lse):
    (query, key, value, attn_mask, out, lse, seed), variants = _restore(ctx)
    dropout_p, is_causal, scale, enable_gqa = ctx.args
    # create_graph=True: autograd runs this with grad mode on and wants gradients with a
    # graph of their own, which the kernels cannot give: take them through torch instead.
    if torch.is_grad_enabled() and any(
            t is not None and t.requires_grad
            for t in (grad_out, query, key, value, attn_mask,
                      *(variants[name] for name in GRAD_NAMES))):
        return _double_backward(ctx, grad_out, query, key, value, attn_mask, seed, variants)
    need = ctx.needs_input_grad
    mask_grad = bool(attn_mask is not None and attn_mask.is_floating_point() and need[3])
    dq, dk, dv, dm, *dvariants = attention_backward(
        grad_out, query, key, value, out, lse, attn_mask, dropout_p, is_causal, scale,
        enable_gqa, seed, mask_grad, *op_values(variants))
    grads = [None] * ctx.n_inputs
    grads[:4] = (dq if need[0] else None, dk if need[1] else None, dv if need[2] else None,
                 dm if mask_grad else None)
    _set_variant_grads(ctx, grads, variants, dvariants, len(FORWARD_ARGS))
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


def _varlen_setup_context(ctx, inputs, output):
    q, k, v, cu_q, cu_k, _, _, dropout_p, is_causal, scale, seed = inputs[:len(VARLEN_ARGS)]
    out, lse = output
    ctx.mark_non_differentiable(lse)
    _, tail = varlen_split_tail(inputs[len(VARLEN_ARGS):])
    _save(ctx, inputs, len(VARLEN_ARGS),
          (q, k, v, out, lse, cu_q, cu_k, seed, *(tail[name] for name in VARLEN_TAIL)))
    ctx.args = (dropout_p, is_causal, scale)


def _sequence_variants(variants, b):
    """The variants of sequence ``b`` of a packed batch: the per-batch tensors' (those that
    fold into the batch dims under vmap: ALiBi slopes ``(B, Hq)``) row ``b``."""
    result = dict(variants)
    for var in TORCH_TENSORS:
        t = variants[var.name]
        if var.vmap == "batch" and t is not None and t.dim() == 2:
            result[var.name] = t[b] if t.shape[0] > 1 else t[0]
    return result


def _varlen_double_backward(ctx, grad_out, q, k, v, cu_q, cu_k, seed, variants):
    """Differentiable first-order gradients (``create_graph=True``), as the dense op's
    :func:`_double_backward`: :func:`_dense_attention` per sequence (the dense stream of
    the sequence's index for dropout), O(L x S) memory per sequence, only on this path."""
    dropout_p, is_causal, scale = ctx.args
    need = list(ctx.needs_input_grad[:3])
    inputs = [t.view_as(t) for t in (q, k, v)]
    variants = _differentiable(variants)
    cq, ck = cu_q.tolist(), cu_k.tolist()
    outs = []
    for b in range(len(cq) - 1):
        qb, kb, vb = (x[c[b]:c[b + 1]].transpose(0, 1) for x, c in zip(inputs, (cq, ck, ck)))
        if kb.shape[1] == 0 or qb.shape[1] == 0:  # no keys: zeros (and no scores to reduce)
            outs.append(q.new_zeros((qb.shape[1], qb.shape[0], v.shape[-1])))
            continue
        out = _dense_attention(qb, kb, vb, None, dropout_p, is_causal, scale, True, seed,
                               _sequence_variants(variants, b), batch_index=b)
        outs.append(out.transpose(0, 1))
    return _graph_grads(ctx, torch.cat(outs), grad_out, inputs, need, variants,
                        len(VARLEN_ARGS))


def _varlen_backward_formula(ctx, grad_out, grad_lse):
    (q, k, v, out, lse, cu_q, cu_k, seed, *tail), variants = _restore(ctx)
    if torch.is_grad_enabled() and any(
            t is not None and t.requires_grad
            for t in (grad_out, q, k, v, *(variants[name] for name in GRAD_NAMES))):
        if any(t is not None for t in tail):
            raise NotImplementedError(
                "double backward (create_graph=True) of sdpa_numba.torch.varlen_attention "
                "with block_table / seqused_k is not built: its first-order gradients are")
        return _varlen_double_backward(ctx, grad_out, q, k, v, cu_q, cu_k, seed, variants)
    dq, dk, dv, *dvariants = varlen_attention_backward(grad_out, q, k, v, out, lse, cu_q, cu_k,
                                                       *ctx.args, seed, *op_values(variants),
                                                       *tail)
    need = ctx.needs_input_grad
    grads = [None] * ctx.n_inputs
    grads[:3] = (dq if need[0] else None, dk if need[1] else None, dv if need[2] else None)
    _set_variant_grads(ctx, grads, variants, dvariants, len(VARLEN_ARGS))
    return tuple(grads)


varlen_attention_forward.register_autograd(_varlen_backward_formula,
                                           setup_context=_varlen_setup_context)
varlen_attention_backward.register_autograd(
    _no_double_backward("varlen_attention_backward", "varlen_attention"),
    setup_context=_setup_nothing)
