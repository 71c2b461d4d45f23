"""The serving operators: ``torch.ops.sdpa_numba.attention_with_kvcache`` (the KV-cache
attention with the append; the caches are its mutated arguments), its read-only twin
``attention_with_kvcache_read`` and ``merge_attention_states``, on the NumPy-level
:func:`sdpa_numba.attention_with_kvcache` and :func:`sdpa_numba.merge_attention_states`, with
their fake (meta) kernels."""

from typing import Optional, Tuple

import torch
from torch import Tensor

from ..kvcache import attention_with_kvcache as _kvcache
from ..merge import merge_attention_states as _merge
from .tensors import (OP_NAMES, as_tensor, cache_operand, check_devices, define_op,
                      host_tensors, index_operand, lse_dtype, op_variants, operand,
                      variant_keywords)


#: The appending op's last arguments, after the variants (added later: optional, so that
#: callers that pass the variants positionally keep working): name, default. The read-only
#: op takes the last three (the scales of a quantized cache, a ragged batch's
#: ``cu_seqlens_q``).
TAIL_ARGS = (("rotary_cos", None), ("rotary_sin", None), ("rotary_interleaved", False),
             ("cache_batch_idx", None), ("k_scale", None), ("v_scale", None),
             ("cu_seqlens_q", None))
_READ_TAIL = ("k_scale", "v_scale", "cu_seqlens_q")
_SCALES_SCHEMA = "Tensor? k_scale=None, Tensor? v_scale=None, Tensor? cu_seqlens_q=None"
# An append into an int8 or q8_0 cache writes the new tokens' scales: mutated, as the caches.
_TAIL_SCHEMA = ("Tensor? rotary_cos=None, Tensor? rotary_sin=None, "
                "bool rotary_interleaved=False, Tensor? cache_batch_idx=None, "
                "Tensor(a3!)? k_scale=None, Tensor(a4!)? v_scale=None, "
                "Tensor? cu_seqlens_q=None")


def _split_tail(variants):
    """``(variants, tail)``: the op's trailing arguments as its variants and a dict of
    :data:`TAIL_ARGS` (the dispatcher leaves out the trailing ones at their defaults)."""
    n = len(OP_NAMES)
    variants, tail = tuple(variants[:n]), tuple(variants[n:])
    return variants, {name: tail[i] if i < len(tail) else default
                      for i, (name, default) in enumerate(TAIL_ARGS)}


def kvcache_forward(q, k_cache, v_cache, cache_seqlens, k=None, v=None, block_table=None,
                    cache_leftpad=None, is_causal=True, scale=None, *variants):
    """The body of both KV-cache operators, and the appending one's kernel:
    :func:`sdpa_numba.attention_with_kvcache` on NumPy views (or CUDA tensors), ``(out,
    lse)`` as tensors (``out`` ``(B, Lq, Hq, Ev)``, ``lse`` ``(B, Hq, Lq)`` in the compute
    dtype; with ``cu_seqlens_q`` ``(total_q, Hq, Ev)`` and ``(Hq, total_q)``). Writes ``k`` and ``v`` into the caches when given (the caches are the appending
    op's mutated arguments). No autograd: an inference operator. ``variants``: the op's
    variant arguments (:func:`.tensors.op_variants`); those left at None are not passed (the
    API's defaults apply). The defaults are the schema's: the dispatcher leaves out the
    arguments at their defaults (torch.compile's calls do).

    The appending op has no vmap (NotImplementedError): the append writes the caches in
    place, and under vmap a batched cache folded into the batch dim is in general a copy (the
    write would be lost), while an unbatched cache would take every index's write at the same
    place. Append outside vmap and vmap the read-only :func:`attention_with_kvcache_read_op`.

    After the variants come :data:`TAIL_ARGS` (``rotary_cos``, ``rotary_sin``,
    ``rotary_interleaved``, ``cache_batch_idx``, a quantized cache's ``k_scale``,
    ``v_scale``, and a ragged batch's ``cu_seqlens_q``), as :func:`sdpa_numba.attention_with_kvcache` takes them (read on the host:
    CPU tensors, or tensors on q's device). An 8-bit cache is an int8 or float8 tensor."""
    variants, rotary = _split_tail(variants)
    variants = op_variants(variants, optional_strings=True)
    _check_kvcache_devices(q, k_cache, v_cache, cache_seqlens, k, v, block_table,
                           cache_leftpad, variants, rotary)
    keywords = variant_keywords(variants, given_only=True)
    if cache_leftpad is not None:
        keywords["cache_leftpad"] = index_operand(cache_leftpad, "cache_leftpad")
    for name in ("rotary_cos", "rotary_sin"):
        if rotary[name] is not None:
            keywords[name] = operand(rotary[name], name)
    for name in ("cache_batch_idx", "cu_seqlens_q"):
        if rotary[name] is not None:
            keywords[name] = index_operand(rotary[name], name)
    if rotary["rotary_interleaved"]:
        keywords["rotary_interleaved"] = True
    for name in ("k_scale", "v_scale"):
        if rotary[name] is not None:
            keywords[name] = operand(rotary[name], name)
    out, lse = _kvcache(operand(q, "q"), cache_operand(k_cache, "k_cache"),
                        cache_operand(v_cache, "v_cache"),
                        index_operand(cache_seqlens, "cache_seqlens"),
                        k=operand(k, "k"), v=operand(v, "v"),
                        block_table=index_operand(block_table, "block_table"),
                        is_causal=is_causal, scale=scale, return_lse=True, **keywords)
    return as_tensor(out), as_tensor(lse)


def _check_kvcache_devices(q, k_cache, v_cache, cache_seqlens, k, v, block_table,
                           cache_leftpad, variants, rotary=None):
    rotary = rotary or {}
    check_devices("attention_with_kvcache",
                  [("q", q), ("k_cache", k_cache), ("v_cache", v_cache), ("k", k), ("v", v)],
                  [("cache_seqlens", cache_seqlens), ("block_table", block_table),
                   ("cache_leftpad", cache_leftpad), *host_tensors(variants),
                   *((name, rotary.get(name)) for name in
                     ("rotary_cos", "rotary_sin", "cache_batch_idx", "k_scale",
                      "v_scale", "cu_seqlens_q"))])


#: The appending op: its own arguments, the variants', then :data:`TAIL_ARGS` (last, so that
#: earlier callers keep working).
attention_with_kvcache_op = define_op(
    "attention_with_kvcache", kvcache_forward,
    "Tensor q, Tensor(a1!) k_cache, Tensor(a2!) v_cache, Tensor cache_seqlens, "
    "Tensor? k=None, Tensor? v=None, Tensor? block_table=None, "
    "Tensor? cache_leftpad=None, bool is_causal=True, float? scale=None",
    mutates_args=("k_cache", "v_cache", "k_scale", "v_scale"), optional_strings=True,
    tail=_TAIL_SCHEMA)


def _kvcache_read_op(q, k_cache, v_cache, cache_seqlens, block_table=None, cache_leftpad=None,
                     is_causal=True, scale=None, *variants):
    """:func:`attention_with_kvcache_op` without the append (no ``k``, ``v``): it only reads
    the caches, so it declares no mutation. (A decode step that attends to a cache filled
    elsewhere, as transformers' are, takes this one: torch 2.13 dispatches a custom operator
    that declares mutated arguments through a Python kernel that costs ~0.1-0.2 ms a call
    with this many arguments, as much as the decode kernel itself on a short cache.)"""
    variants, tail = _split_read_tail(variants)
    return kvcache_forward(q, k_cache, v_cache, cache_seqlens, None, None, block_table,
                           cache_leftpad, is_causal, scale, *variants,
                           *(tail[name] for name, _ in TAIL_ARGS))


def _split_read_tail(variants):
    """The read-only op's trailing arguments: its variants (padded to all of them) and a
    :data:`TAIL_ARGS` dict with its ``k_scale``, ``v_scale``, ``cu_seqlens_q``."""
    n = len(OP_NAMES)
    given = tuple(variants[n:]) + (None,) * len(_READ_TAIL)
    values = tuple(op_variants(variants[:n], optional_strings=True)[name] for name in OP_NAMES)
    tail = dict(TAIL_ARGS)
    tail.update(zip(_READ_TAIL, given))
    return values, tail


attention_with_kvcache_read_op = define_op(
    "attention_with_kvcache_read", _kvcache_read_op,
    "Tensor q, Tensor k_cache, Tensor v_cache, Tensor cache_seqlens, "
    "Tensor? block_table=None, Tensor? cache_leftpad=None, bool is_causal=True, "
    "float? scale=None", optional_strings=True, tail=_SCALES_SCHEMA)


def _kvcache_shapes(q, v_cache, cu_seqlens_q):
    if cu_seqlens_q is not None:  # a ragged batch: q packed (total_q, Hq, E)
        total_q, Hq = q.shape[:2]
        return (q.new_empty((total_q, Hq, v_cache.shape[-1])),
                q.new_empty((Hq, total_q), dtype=lse_dtype(q.dtype)))
    B, Lq, Hq, _ = q.shape
    return (q.new_empty((B, Lq, Hq, v_cache.shape[-1])),
            q.new_empty((B, Hq, Lq), dtype=lse_dtype(q.dtype)))


@attention_with_kvcache_op.register_fake
def _(q, k_cache, v_cache, cache_seqlens, k=None, v=None, block_table=None,
      cache_leftpad=None, is_causal=True, scale=None, *variants):
    variants, rotary = _split_tail(variants)
    _check_kvcache_devices(q, k_cache, v_cache, cache_seqlens, k, v, block_table,
                           cache_leftpad, op_variants(variants, optional_strings=True), rotary)
    return _kvcache_shapes(q, v_cache, rotary["cu_seqlens_q"])


@attention_with_kvcache_read_op.register_fake
def _(q, k_cache, v_cache, cache_seqlens, block_table=None, cache_leftpad=None,
      is_causal=True, scale=None, *variants):
    variants, tail = _split_read_tail(variants)
    _check_kvcache_devices(q, k_cache, v_cache, cache_seqlens, None, None, block_table,
                           cache_leftpad, op_variants(variants, optional_strings=True), tail)
    return _kvcache_shapes(q, v_cache, tail["cu_seqlens_q"])


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
    return operand(t, name)


@torch.library.custom_op("sdpa_numba::merge_attention_states", mutates_args=())
def merge_attention_states_op(out_a: Tensor, lse_a: Tensor, out_b: Optional[Tensor] = None,
                              lse_b: Optional[Tensor] = None) -> Tuple[Tensor, Tensor]:
    """``(out, lse)`` of :func:`sdpa_numba.merge_attention_states`: two parts ``(out_a,
    lse_a, out_b, lse_b)``, or ``n`` stacked parts ``(outs, lses)`` with ``out_b`` and
    ``lse_b`` None."""
    _check_merge_devices(out_a, lse_a, out_b, lse_b)
    states = [operand(out_a, "out_a"), _lse_operand(lse_a, "lse_a")]
    if out_b is not None or lse_b is not None:
        states += [operand(out_b, "out_b"), _lse_operand(lse_b, "lse_b")]
    out, lse = _merge(*states)
    return as_tensor(out), as_tensor(lse)


def _check_merge_devices(out_a, lse_a, out_b, lse_b):
    check_devices("merge_attention_states", [("out_a", out_a), ("lse_a", lse_a),
                                             ("out_b", out_b), ("lse_b", lse_b)])


@merge_attention_states_op.register_fake
def _(out_a, lse_a, out_b=None, lse_b=None):
    _check_merge_devices(out_a, lse_a, out_b, lse_b)
    shape = out_a.shape if out_b is not None else out_a.shape[1:]
    return (out_a.new_empty(shape), out_a.new_empty(shape[:-1],
                                                    dtype=lse_dtype(out_a.dtype)))
