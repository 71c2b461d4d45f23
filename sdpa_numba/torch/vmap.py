"""vmap rules of the operators (torch >= 2.5, ``register_vmap``; skipped before it): the
vmapped dim becomes one more leading batch dim of the dense operators (batched ALiBi slopes
included; with sinks, or dropout, one call per vmapped index), folds into the batch dim of the
read-only KV-cache operator, and leads the merge's operands; the appending KV-cache operator
refuses vmap (an in-place write)."""

import torch
from torch import Tensor

from ..problem.variant_table import TORCH_TENSORS
from .dense import BACKWARD_ARGS, FORWARD_ARGS, attention_backward, attention_forward
from .serving import (attention_with_kvcache_op, attention_with_kvcache_read_op,
                      merge_attention_states_op)
from .tensors import OP_NAMES, op_values, op_variants, out_shape


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


def _fold_batched(info, t, d, R):
    """A per-batch variant tensor (ALiBi slopes: vmap "batch" in the table) under vmap:
    unbatched ones as they are (they broadcast against the scores' batch dims from the
    right); batched ones with the vmapped dim first and ones after it, as the folded scores'
    batch dims (the tensor's rank is the scores' minus 2)."""
    if t is None or d is None:
        return t
    r = t.dim() - 1
    return _fold(info.batch_size, (d,), (t,), (r + 2,), R)[0]


def _variant_dims(in_dims, n_own):
    """The op's variant arguments' in_dims (a dict), after its ``n_own`` own arguments."""
    return dict(zip(OP_NAMES, in_dims[n_own:]))


def _loops(variants):
    """Whether a vmapped call goes one index at a time for these variants (a dict): a tensor
    whose vmap rule is "loop" (sinks: ``(Hq,)`` per call, and per-index gradients) is given."""
    return any(variants[v.name] is not None for v in TORCH_TENSORS if v.vmap == "loop")


def _fold_variants(info, variants, dims, R):
    """The op's variant arguments in order, the per-batch tensors folded (:func:`_fold_batched`)."""
    folded = dict(variants)
    for v in TORCH_TENSORS:
        if v.vmap == "batch":
            folded[v.name] = _fold_batched(info, variants[v.name], dims[v.name], R)
    return op_values(folded)


def _forward_vmap(info, in_dims, query, key, value, attn_mask, dropout_p, is_causal, scale,
                  enable_gqa, seed, *variants):
    n_own = len(FORWARD_ARGS)
    variants = op_variants(variants)
    args = (query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, seed,
            *op_values(variants))
    in_dims = _all_dims(in_dims, args)
    # sinks are (Hq,) per call: batched ones cannot fold into the batch dims, so one call per
    # index (unbatched ones too: simpler, and vmap's per-index sinks gradients need it)
    if dropout_p > 0 or _loops(variants):
        return _vmap_loop(attention_forward, info, in_dims, args)
    tensors, dims = (query, key, value, attn_mask), in_dims[:4]
    shapes = [_logical(t, d) for t, d in zip(tensors, dims)]
    ranks = [None if s is None else len(s) for s in shapes]
    R = max(max(r for r in ranks if r is not None), 3)
    q, k, v, m = _fold(info.batch_size, dims, tensors, ranks, R)
    out, lse = attention_forward(q, k, v, m, dropout_p, is_causal, scale, enable_gqa, None,
                                 *_fold_variants(info, variants,
                                                 _variant_dims(in_dims, n_own), R))
    logical = out_shape(*(torch.empty(s, device="meta") for s in shapes[:3]), enable_gqa)
    B = info.batch_size
    return (out.reshape(B, *logical), lse.reshape(B, *logical[:-1])), (0, 0)


def _backward_vmap(info, in_dims, grad_out, query, key, value, out, lse, attn_mask, dropout_p,
                   is_causal, scale, enable_gqa, seed, mask_grad, *variants):
    n_own = len(BACKWARD_ARGS)
    variants = op_variants(variants)
    args = (grad_out, query, key, value, out, lse, attn_mask, dropout_p, is_causal, scale,
            enable_gqa, seed, mask_grad, *op_values(variants))
    in_dims = _all_dims(in_dims, args)
    if dropout_p > 0 or _loops(variants):  # sinks: per-index gradients, as in the forward
        return _vmap_loop(attention_backward, info, in_dims, args)
    tensors = (grad_out, query, key, value, out, lse, attn_mask)
    dims = in_dims[:7]
    shapes = [_logical(t, d) for t, d in zip(tensors, dims)]
    ranks = [None if s is None else len(s) for s in shapes]
    R = max(max(r for r in ranks if r is not None), 3)
    # lse has one dim less than out: pad it as out is padded (one more logical dim)
    ranks[5] += 1
    folded = _fold(info.batch_size, dims, tensors, ranks, R)
    dq, dk, dv, dm, *dvariants = attention_backward(
        *folded, dropout_p, is_causal, scale, enable_gqa, None, mask_grad,
        *_fold_variants(info, variants, _variant_dims(in_dims, n_own), R))
    B = info.batch_size
    grads = [g.reshape(B, *s) for g, s in zip((dq, dk, dv), shapes[1:4])]
    # the variants' gradients: empty here (those given loop above)
    none = (None,) * len(dvariants)
    if mask_grad:
        return (*grads, dm.reshape(B, *shapes[6]), *dvariants), (0, 0, 0, 0, *none)
    return (*grads, dm, *dvariants), (0, 0, 0, None, *none)


def _flat(info, t, d):
    """``t`` with the vmapped dim folded into its first (batch) dim: ``(N * B, ...)``."""
    return None if t is None else _leading(info.batch_size, t, d).flatten(0, 1)


def _kvcache_read_vmap(info, in_dims, q, k_cache, v_cache, cache_seqlens, block_table=None,
                       cache_leftpad=None, is_causal=True, scale=None, *variants):
    """The read-only KV-cache op under vmap: the vmapped dim folds into the batch dim (a
    paged cache's pages too, the block table offset to each index's pages, per-batch variant
    tensors such as ALiBi slopes expanded to ``(N * B, Hq)``); batched "loop" tensors (sinks
    ``(Hq,)``) cannot fold, so one call per index."""
    n_own = 8
    if any(t is not None for t in variants[len(OP_NAMES):]):
        raise NotImplementedError(
            "sdpa_numba.torch.attention_with_kvcache under torch.vmap takes no k_scale, "
            "v_scale or cu_seqlens_q: fold the mapped dim into the batch (or the packed rows) "
            "and call it once")
    variants = op_variants(variants, optional_strings=True)
    args = (q, k_cache, v_cache, cache_seqlens, block_table, cache_leftpad, is_causal, scale,
            *op_values(variants))
    in_dims = _all_dims(in_dims, args)
    dims = _variant_dims(in_dims, n_own)
    if any(dims[v.name] is not None for v in TORCH_TENSORS if v.vmap == "loop"):
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
    for v in TORCH_TENSORS:
        t = variants[v.name]
        if v.vmap == "batch" and t is not None and (dims[v.name] is not None or t.dim() == 2):
            variants[v.name] = (_leading(N, t, dims[v.name]).reshape(N, -1, hq)
                                .expand(N, B, hq).flatten(0, 1))
    out, lse = attention_with_kvcache_read_op(
        qf, kc, vc, _flat(info, cache_seqlens, in_dims[3]), block_table,
        _flat(info, cache_leftpad, in_dims[5]), is_causal, scale, *op_values(variants))
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



if hasattr(attention_forward, "register_vmap"):  # torch >= 2.5
    attention_forward.register_vmap(_forward_vmap)
    attention_backward.register_vmap(_backward_vmap)
    attention_with_kvcache_read_op.register_vmap(_kvcache_read_vmap)
    attention_with_kvcache_op.register_vmap(_kvcache_vmap)
    merge_attention_states_op.register_vmap(_merge_vmap)
