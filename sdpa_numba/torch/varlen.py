"""The varlen operators ``torch.ops.sdpa_numba.varlen_attention_forward`` and
``varlen_attention_backward`` on :func:`sdpa_numba.varlen_attention` and its backward
(ragged batches packed back to back), with their fake (meta) kernels. Their schemas end with
the variants' arguments, as the dense operators' (:mod:`.dense`), then :data:`TAIL_ARGS`
(keys through a paged cache; added later, optional so that positional callers keep
working)."""


from ..varlen import varlen_attention as _varlen
from ..varlen import varlen_attention_backward as _varlen_backward
from .dense import GRAD_NAMES, fake_variant_grads, variant_grads
from .tensors import (OP_NAMES, as_tensor, check_devices, define_op, host_tensors,
                      index_operand, kernel_seed, lse_dtype, op_variants, operand,
                      variant_keywords)

#: The forward's own arguments (before the variants').
FORWARD_ARGS = ("q", "k", "v", "cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k",
                "dropout_p", "is_causal", "scale", "seed")
#: Both ops' last arguments, after the variants: :func:`sdpa_numba.varlen_attention`'s keys
#: through a paged cache (``block_table``) or the first keys of each sequence
#: (``seqused_k``); integer tensors read on the host.
TAIL_ARGS = ("block_table", "seqused_k")
_TAIL_SCHEMA = "Tensor? block_table=None, Tensor? seqused_k=None"


def split_tail(values):
    """``(variants, tail)``: the ops' trailing arguments as the variants (a dict,
    :func:`.tensors.op_variants`) and the :data:`TAIL_ARGS` dict (the dispatcher leaves out
    the trailing ones at their defaults)."""
    n = len(OP_NAMES)
    tail = tuple(values[n:]) + (None,) * len(TAIL_ARGS)
    return op_variants(values[:n]), dict(zip(TAIL_ARGS, tail))


def _tail_keywords(tail):
    return {name: index_operand(tail[name], name) for name in TAIL_ARGS
            if tail[name] is not None}


def _check_devices(op, tensors, cu_seqlens_q, cu_seqlens_k, seed, variants, tail):
    check_devices(op, tensors, [("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k),
                                ("seed", seed), *host_tensors(variants), *tail.items()])


def _varlen_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
                    is_causal, scale, seed, *variants):
    """``(out, lse)`` of :func:`sdpa_numba.varlen_attention` on packed ``q`` ``(total_q, Hq,
    E)``, ``k`` / ``v`` ``(total_k, H, ·)``: ``out`` ``(total_q, Hq, Ev)``, ``lse`` ``(Hq,
    total_q)`` in the compute dtype. ``cu_seqlens_*``: int32/int64 tensors ``(B + 1,)``, read
    on the host (``cu_seqlens_k`` may be None with a ``block_table``). ``seed`` and the
    variants as in :func:`.dense.attention_forward`; then :data:`TAIL_ARGS`."""
    variants, tail = split_tail(variants)
    _check_devices("varlen_attention_forward", [("q", q), ("k", k), ("v", v)], cu_seqlens_q,
                   cu_seqlens_k, seed, variants, tail)
    out, lse = _varlen(operand(q, "q"), operand(k, "k"), operand(v, "v"),
                       index_operand(cu_seqlens_q, "cu_seqlens_q"),
                       index_operand(cu_seqlens_k, "cu_seqlens_k"),
                       max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k,
                       is_causal=is_causal, scale=scale, dropout_p=dropout_p,
                       seed=kernel_seed(seed), return_lse=True, **variant_keywords(variants),
                       **_tail_keywords(tail))
    return as_tensor(out), as_tensor(lse)


varlen_attention_forward = define_op(
    "varlen_attention_forward", _varlen_forward,
    "Tensor q, Tensor k, Tensor v, Tensor cu_seqlens_q, Tensor? cu_seqlens_k, "
    "SymInt? max_seqlen_q, SymInt? max_seqlen_k, float dropout_p, bool is_causal, "
    "float? scale, Tensor? seed", tail=_TAIL_SCHEMA)


@varlen_attention_forward.register_fake
def _(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, is_causal,
      scale, seed, *variants):
    _check_devices("varlen_attention_forward", [("q", q), ("k", k), ("v", v)], cu_seqlens_q,
                   cu_seqlens_k, seed, *split_tail(variants))
    # the shapes depend on the inputs' shapes only (symbolic under torch.compile)
    total_q, hq = q.shape[:2]
    return (q.new_empty((total_q, hq, v.shape[-1])),
            q.new_empty((hq, total_q), dtype=lse_dtype(q.dtype)))


def _check_backward_devices(grad_out, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, seed,
                            variants, tail):
    _check_devices("varlen_attention_backward",
                   [("grad_out", grad_out), ("q", q), ("k", k), ("v", v), ("out", out),
                    ("lse", lse)], cu_seqlens_q, cu_seqlens_k, seed, variants, tail)


def _varlen_backward_op(grad_out, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, dropout_p,
                        is_causal, scale, seed, *variants):
    """``(dq, dk, dv, *dvariants)`` of :func:`sdpa_numba.varlen_attention_backward`; one
    gradient per variant that has one (the sinks), an empty tensor unless it is given (then
    its shape, dtype and device). ALiBi slopes get no gradient. With a ``block_table``,
    ``dk``/``dv`` have the caches' shapes."""
    variants, tail = split_tail(variants)
    _check_backward_devices(grad_out, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, seed,
                            variants, tail)
    grads = _varlen_backward(operand(grad_out, "grad_out"), operand(q, "q"),
                             operand(k, "k"), operand(v, "v"), operand(out, "out"),
                             operand(lse, "lse"), index_operand(cu_seqlens_q, "cu_seqlens_q"),
                             index_operand(cu_seqlens_k, "cu_seqlens_k"), is_causal=is_causal,
                             scale=scale, dropout_p=dropout_p, seed=kernel_seed(seed),
                             **variant_keywords(variants), **_tail_keywords(tail))
    dq, dk, dv = (as_tensor(g) for g in grads[:3])
    return (dq, dk, dv, *variant_grads(grads[3:], variants, q))


varlen_attention_backward = define_op(
    "varlen_attention_backward", _varlen_backward_op,
    "Tensor grad_out, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, "
    "Tensor cu_seqlens_q, Tensor? cu_seqlens_k, float dropout_p, bool is_causal, "
    "float? scale, Tensor? seed", 3 + len(GRAD_NAMES), tail=_TAIL_SCHEMA)


@varlen_attention_backward.register_fake
def _(grad_out, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, dropout_p, is_causal, scale,
      seed, *variants):
    variants, tail = split_tail(variants)
    _check_backward_devices(grad_out, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, seed,
                            variants, tail)
    return (q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape),
            *fake_variant_grads(variants, q))
