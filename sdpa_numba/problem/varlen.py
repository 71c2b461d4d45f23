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
from .variants import check_alignment, host_array, variants_recipe


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


def _host_ints(name, x):
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
    a = _host_ints(name, x)
    if a.ndim != 1 or a.shape[0] < 1:
        raise ValueError(f"{name} must have shape (B + 1,), got shape {shape_str(a)}")
    a = a.astype(np.int64)
    if a[0] != 0:
        raise ValueError(f"{name} must start at 0, got {name}[0] = {a[0]}")
    steps = np.diff(a)
    if np.any(steps < 0):
        i = int(np.argmax(steps < 0))
        raise ValueError(f"{name} must not decrease: {name}[{i}] = {a[i]} > {name}[{i + 1}] "
                         f"= {a[i + 1]}")
    if a[-1] != total:
        raise ValueError(f"{name} must end at {what}'s total rows {total}, got {name}[-1] = "
                         f"{a[-1]}")
    return a


def _check_max(name, given, lengths):
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
        _check_max("max_seqlen_q", max_seqlen_q, np.diff(cu_q))
    if max_seqlen_k is not None:
        _check_max("max_seqlen_k", max_seqlen_k, np.diff(cu_k))
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


def _cu_lengths(name, x, n_seq):
    """An optional ``cu_seqlens_k`` given with ``block_table`` (lengths only, FlashAttention
    2's paged varlen): int64 (B + 1,), from 0, never decreasing; its last entry is free."""
    a = _host_ints(name, x)
    if a.shape != (n_seq + 1,):
        raise ValueError(f"{name} must have shape (B + 1,) = ({n_seq + 1},) (cu_seqlens_q's), "
                         f"got shape {shape_str(a)}")
    a = a.astype(np.int64)
    return check_cu_seqlens(name, a, int(a[-1]), "its own")


def cache_varlen_problem(q, k, v, cu_seqlens_q, cu_seqlens_k, block_table, seqused_k, *,
                         max_seqlen_q=None, max_seqlen_k=None, is_causal=False, scale=None,
                         alignment="top_left", block_mask=None, as_strided=None,
                         **variants):
    """Validate :func:`sdpa_numba.varlen_attention` with ``block_table`` and / or
    ``seqused_k`` (keys read through a paged cache, or the first keys of each packed
    sequence): ``(k_cache, v_cache, problem)``, the caches the decode kernels read and their
    :class:`~.kvcache.KVCacheProblem` (a ragged batch in the sequences' own frame,
    :func:`~.kvcache.ragged_table`).

    Host (NumPy) operands. With ``block_table`` (int (B, max_pages)), ``k`` and ``v`` are
    paged caches ``(num_pages, page_size, H, E / Ev)`` and sequence ``b``'s keys are its
    first ``seqused_k[b]`` tokens through its pages; ``cu_seqlens_k``, if given, only gives
    lengths (``seqused_k`` defaults to them and may not exceed them). Without it, ``k``,
    ``v`` are packed ``(total_k, H, E / Ev)``, ``cu_seqlens_k`` is required and sequence
    ``b``'s keys are the first ``seqused_k[b]`` of its range, seen as pages of ``g`` rows
    (``g`` the gcd of ``cu_seqlens_k``: a strided view, no copy) with a block table made
    here (``as_strided(x, shape, strides)``: the target's view; None: NumPy's). TypeError /
    ValueError naming the argument.
    """
    from .kvcache import _check_cache_strides, kvcache_problem

    if block_mask is not None:
        raise ValueError("block_mask is not supported by varlen_attention: a BlockMask is one "
                         "grid of blocks over a single (L, S) shape, and the sequences of a "
                         "ragged batch have different shapes; pass its mask_mod instead "
                         "(evaluated per sequence, with b the sequence index)")
    paged = block_table is not None
    if q.ndim != 3:
        raise ValueError(f"q must have 3 dims (total_q, heads, head dim), got shape "
                         f"{shape_str(q)}")
    kd = 4 if paged else 3
    dims = ("(num_pages, page_size, H, E) with block_table" if paged
            else "(total_k, H, E)")
    for name, x in (("k", k), ("v", v)):
        if x.ndim != kd:
            what = dims.replace("E)", "Ev)") if name == "v" else dims
            raise ValueError(f"{name} must have {kd} dims {what}, got shape {shape_str(x)}")
    dtype = check_storage_dtype("q", q)
    for name, x in (("k", k), ("v", v)):
        check_storage_dtype(name, x, ("q", dtype))
    total_q, hq, E = (int(n) for n in q.shape)
    if int(k.shape[kd - 1]) != E:
        raise ValueError(f"k's last dim must equal q's: q {shape_str(q)}, k {shape_str(k)}")
    if tuple(v.shape[:kd - 1]) != tuple(k.shape[:kd - 1]):
        raise ValueError(f"v must have k's dims but the last: k {shape_str(k)}, v "
                         f"{shape_str(v)}")
    h = int(k.shape[kd - 2])
    if h == 0 or hq % h:
        raise ValueError(f"q's heads must be a multiple of k's (grouped-query attention), and "
                         f"k must have at least one: q {shape_str(q)}, k {shape_str(k)}")
    for name, x in (("k", k), ("v", v)):
        if paged:
            _check_cache_strides(name, x)
        elif x.shape[2] > 1 and x.strides[2] != x.dtype.itemsize and x.size:
            raise ValueError(f"{name}'s last dim must be contiguous (stride "
                             f"{x.dtype.itemsize} bytes) with seqused_k, got strides "
                             f"{tuple(x.strides)}")
    cu_q = check_cu_seqlens("cu_seqlens_q", cu_seqlens_q, total_q, "q")
    n_seq = len(cu_q) - 1
    used = None
    if seqused_k is not None:
        used = _host_ints("seqused_k", seqused_k)
        if used.shape != (n_seq,):
            raise ValueError(f"seqused_k must have shape (B,) = ({n_seq},) (cu_seqlens_q's "
                             f"sequences), got shape {shape_str(used)}")
        used = used.astype(np.int64)
        if n_seq and used.min() < 0:
            b = int(np.argmax(used < 0))
            raise ValueError(f"seqused_k must be >= 0, got seqused_k[{b}] = {used[b]}")
    if paged:
        cu_k = None if cu_seqlens_k is None else _cu_lengths("cu_seqlens_k", cu_seqlens_k,
                                                              n_seq)
        if used is None and cu_k is None:
            raise ValueError("block_table needs the keys of each sequence: pass seqused_k "
                             "(or cu_seqlens_k, whose lengths are then used)")
    else:
        if cu_seqlens_k is None:
            raise ValueError("cu_seqlens_k is required without block_table (where each "
                             "sequence's keys lie in k)")
        cu_k = check_cu_seqlens("cu_seqlens_k", cu_seqlens_k, int(k.shape[0]), "k")
        if cu_k.shape != cu_q.shape:
            raise ValueError(f"cu_seqlens_q and cu_seqlens_k must hold the same number of "
                             f"sequences: shapes {shape_str(cu_q)} and {shape_str(cu_k)}")
    if cu_k is not None:
        lengths = np.diff(cu_k)
        if used is None:
            used = lengths
        elif np.any(used > lengths):
            b = int(np.argmax(used > lengths))
            raise ValueError(f"seqused_k[{b}] = {used[b]} is more than sequence {b}'s keys in "
                             f"cu_seqlens_k ({lengths[b]})")
    if max_seqlen_q is not None:
        _check_max("max_seqlen_q", max_seqlen_q, np.diff(cu_q))
    if max_seqlen_k is not None:
        _check_max("max_seqlen_k", max_seqlen_k, used)
    bottom_right = check_alignment(alignment) == "bottom_right"
    if paged:
        k_cache, v_cache, table = k, v, host_array("block_table", block_table)
    else:
        # The packed rows as pages of g rows (g divides every sequence's start): sequence b's
        # keys are pages cu_k[b] // g, cu_k[b] // g + 1, .. of that view.
        g = int(np.gcd.reduce(cu_k)) or 1
        n_pages = int(k.shape[0]) // g

        def pages(x):
            s0, s1, s2 = x.strides
            shape, strides = (n_pages, g, x.shape[1], x.shape[2]), (g * s0, s0, s1, s2)
            if as_strided is not None:
                return as_strided(x, shape, strides)
            return np.lib.stride_tricks.as_strided(x, shape, strides, writeable=False)
        k_cache, v_cache = pages(k), pages(v)
        width = max(1, int(-(-used.max() // g)) if n_seq else 1)
        table = np.minimum(cu_k[:-1, None] // g + np.arange(width)[None, :],
                           max(n_pages - 1, 0)).astype(np.int32)
    p = kvcache_problem(q, k_cache, v_cache, used, None, None, table, None, is_causal, scale,
                        cu_seqlens_q=cu_q, sequence_frame=bottom_right, **variants)
    return k_cache, v_cache, p
