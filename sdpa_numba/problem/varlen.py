"""The validated packed (varlen) problem: :func:`varlen_plan` checks a ragged batch packed as
FlashAttention's ``flash_attn_varlen_func`` lays it out and returns a :class:`VarlenPlan`.

Target-neutral: the operands need ``shape``, ``ndim`` and a NumPy ``dtype``; the
``cu_seqlens`` are read on the host (they are small), since their values must be checked.
"""

import numbers
from dataclasses import dataclass

import numpy as np

from ..score.recipe import Recipe
from .arguments import check_flag, check_scale, shape_str
from .dtypes import check_storage_dtype, compute_dtype
from .out import given_arrays
from .variant_table import host_array
from .variants import check_alignment, variants_recipe


@dataclass(frozen=True)
class VarlenPlan:
    """A packed ragged batch after validation.

    ``cu_q``, ``cu_k``: the cumulative sequence lengths as int64 NumPy arrays of shape
    ``(B + 1,)``; ``out_shape`` ``(total_q, Hq, Ev)``; ``lse_shape`` ``(Hq, total_q)``;
    ``bottom_right``: causal mask, window and ALiBi aligned per sequence to the bottom right.
    """

    n_seq: int
    hq: int
    h: int
    E: int
    Ev: int
    cu_q: np.ndarray
    cu_k: np.ndarray
    out_shape: tuple
    lse_shape: tuple
    dtype: np.dtype
    compute_dtype: np.dtype
    scale: float
    is_causal: bool
    bottom_right: bool
    recipe: Recipe
    #: The call's other arrays as given (cu_seqlens, ALiBi slopes, sinks, mod_args arrays),
    #: ``(name, array)`` pairs that ``out`` must not overlap (see :class:`~.plan.Plan`).
    given: tuple = ()


def host_ints(name, x):
    """``x`` (a host array, or a CUDA array: copied) as a NumPy array, checked for an integer
    dtype."""
    a = host_array(name, x)
    if a.dtype.kind not in "iu" or a.dtype == np.bool_:
        raise TypeError(f"{name} must be an integer array (int32 or int64), got dtype "
                        f"{a.dtype}")
    return a


def check_cu_seqlens(name, x, total, what):
    """``cu_seqlens`` as int64 of shape (B + 1,): starting at 0, never decreasing, ending at
    ``total`` (``what`` names the array whose rows it splits)."""
    a = host_ints(name, x)
    if a.ndim != 1 or a.shape[0] < 1:
        raise ValueError(f"{name} must have shape (B + 1,), got shape {shape_str(a)}")
    a = a.astype(np.int64)
    # On a Python list: a few NumPy calls on a (B + 1,) array cost ~20 us of a small call.
    starts = a.tolist()
    if starts[0] != 0:
        raise ValueError(f"{name} must start at 0, got {name}[0] = {a[0]}")
    if starts != sorted(starts):
        i = int(np.argmax(np.diff(a) < 0))
        raise ValueError(f"{name} must not decrease: {name}[{i}] = {a[i]} > {name}[{i + 1}] "
                         f"= {a[i + 1]}")
    if starts[-1] != total:
        raise ValueError(f"{name} must end at {what}'s total rows {total}, got {name}[-1] = "
                         f"{a[-1]}")
    return a


def check_max_seqlen(name, given, lengths):
    """A ``max_seqlen_*`` hint: None, or an int at least the longest sequence."""
    if given is None:
        return
    if isinstance(given, (bool, np.bool_)) or not isinstance(given, numbers.Integral):
        raise TypeError(f"{name} must be an int or None, got {type(given).__name__}")
    real = int(lengths.max()) if lengths.size else 0
    if int(given) < real:
        raise ValueError(f"{name} = {int(given)} is smaller than the longest sequence "
                         f"({real})")


def varlen_plan(q, k, v, cu_seqlens_q, cu_seqlens_k, *, max_seqlen_q=None, max_seqlen_k=None,
                is_causal=False, scale=None, backward=False, window=None,
                alignment="top_left", block_mask=None, **variants):
    """Validate a packed batch and its variants; return a :class:`VarlenPlan`.

    ``variants``: ``softcap``, ``alibi_slopes`` ((Hq,) or (B, Hq)), ``sinks``, ``score_mod``,
    ``mask_mod``, ``mod_args``, ``score_mod_grad``, validated by
    :func:`~sdpa_numba.problem.variants.variants_recipe`. ``block_mask`` is refused.
    """
    is_causal = check_flag("is_causal", is_causal)
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x.ndim != 3:
            raise ValueError(f"{name} must have 3 dims (total, heads, head dim), got shape "
                             f"{shape_str(x)}")
    dtype = check_storage_dtype("q", q)
    for name, x in (("k", k), ("v", v)):
        check_storage_dtype(name, x, ("q", dtype))
    total_q, hq, E = (int(n) for n in q.shape)
    total_k, h, Ek = (int(n) for n in k.shape)
    if Ek != E:
        raise ValueError(f"k's last dim must equal q's: q {shape_str(q)}, k {shape_str(k)}")
    if tuple(v.shape[:2]) != (total_k, h):
        raise ValueError(f"v must have k's rows and heads: k {shape_str(k)}, v {shape_str(v)}")
    Ev = int(v.shape[2])
    if h == 0 or hq % h:
        raise ValueError(f"q's heads must be a multiple of k's (grouped-query attention), and "
                         f"k must have at least one: q {shape_str(q)}, k {shape_str(k)}")
    cu_q = check_cu_seqlens("cu_seqlens_q", cu_seqlens_q, total_q, "q")
    cu_k = check_cu_seqlens("cu_seqlens_k", cu_seqlens_k, total_k, "k")
    if cu_q.shape != cu_k.shape:
        raise ValueError(f"cu_seqlens_q and cu_seqlens_k must hold the same number of "
                         f"sequences: shapes {shape_str(cu_q)} and {shape_str(cu_k)}")
    # The lengths only where a hint is given to check (np.diff: ~2 us each of a small call)
    if max_seqlen_q is not None:
        check_max_seqlen("max_seqlen_q", max_seqlen_q, np.diff(cu_q))
    if max_seqlen_k is not None:
        check_max_seqlen("max_seqlen_k", max_seqlen_k, np.diff(cu_k))
    if block_mask is not None:
        raise ValueError("block_mask is not supported by varlen_attention: a BlockMask is one "
                         "grid of blocks over a single (L, S) shape, and the sequences of a "
                         "ragged batch have different shapes; pass its mask_mod instead "
                         "(evaluated per sequence, with b the sequence index)")
    scale = check_scale(scale, E)
    bottom_right = check_alignment(alignment) == "bottom_right"
    cdt = compute_dtype(dtype)
    n_seq = cu_q.shape[0] - 1
    # The recipe's offset is set per sequence by the kernels (bottom_right); here it is 0.
    r = variants_recipe((n_seq,), hq, 0, 0, cdt, is_causal, window=window,
                        backward=backward, **variants)
    return VarlenPlan(n_seq, hq, h, E, Ev, cu_q, cu_k, (total_q, hq, Ev), (hq, total_q), dtype,
                      cdt, scale, is_causal, bottom_right, r,
                      given_arrays(variants, cu_seqlens_q=cu_seqlens_q,
                                   cu_seqlens_k=cu_seqlens_k))
