"""``attention_with_kvcache``: new query tokens against a key/value cache, contiguous or paged,
with an optional in-place append of the new keys and values, left padding and the attention
variants (FlashAttention's ``flash_attn_with_kvcache`` layouts).

Everything is validated before anything is written: a bad argument leaves the cache untouched.
The variants become the score seam's recipe
(:func:`sdpa_numba.problem.variants.variants_recipe`) in the cache's frame, and
:func:`key_bounds` the keys each sequence's kernel reads. The kernels are
:func:`sdpa_numba.cpu.decode.decode` and :func:`sdpa_numba.gpu.decode.decode`.
"""

import numbers
from typing import Any

import numpy as np

from ._bf16 import is_bfloat16
from ._runtime import check_jit, compile_entry, kernel_launch
from .host_arrays import adopt as adopt_host
from .host_arrays import as_numpy
from .problem.arguments import check_flag, check_scale, shape_str
from .problem.dtypes import FLOATS, compute_dtype
from .problem.out import host_address, may_overlap, may_self_overlap
from .problem.variants import check_alignment, variants_recipe

__all__ = ["attention_with_kvcache"]

#: Bytes of keys and values read below which a call runs on the calling thread, without a
#: parallel launch. Serial and parallel runs give bitwise the same result, so the threshold
#: never changes a result; it depends on the shapes and lengths only. Measured (2 threads,
#: median after 50 ms idle, B1 H8 D128 float32, a loaded machine): a parallel launch costs
#: ~0.16 ms more than a serial call (0.26 against 0.10 ms at 0.5 MiB), and serial calls
#: stream ~16 GB/s, so two threads would pay off from about 2 x 0.16 ms x 16 GB/s ~ 4 MiB;
#: but at 2 MiB serial took 0.27 ms, parallel 0.41, at 8 MiB 0.62 and 0.78 with the second
#: core busy, and at B1 Hq12 H4 S2080 D64 (4.1 MiB, a transformers decode step; AMD EPYC,
#: back-to-back calls) the serial kernel 0.33 ms, the parallel 0.40 (min of 40). Hence 8 MiB.
SERIAL_BYTES = 8 << 20

_entries: dict = {}


def _is_device(x):
    return hasattr(x, "__cuda_array_interface__") or type(x).__name__ in (
        "FakeCUDAArray", "DeviceNDArray")


def _entry(parallel, dtype, recipe_t):
    """The compiled decode for a storage dtype and recipe type (plain, windowed and soft-capped
    calls share the plain recipe's type: their numbers are run-time values)."""
    from numba import types

    from .cpu.decode import decode, decode_serial
    from .cpu.launch import arr, kernel_types

    # Looked up by the type's identity first: hashing a recipe's Numba type walks all its
    # fields (~10 us a call); Numba interns types, so the same recipe gives the same object.
    fast = _entries.get((parallel, dtype, id(recipe_t)))
    if fast is not None and fast[0] is recipe_t:
        return fast[1]
    key = (parallel, dtype, recipe_t)
    if key not in _entries:
        st, ct, _ = kernel_types(dtype, "none")
        sig = (arr(st, 4, True), arr(st, 4, True), arr(st, 4, True),
               arr(types.int32, 2, True), arr(types.int64, 1, True), types.boolean,
               types.float64, arr(st, 4, False), arr(ct, 3, False), recipe_t,
               arr(types.int64, 1, True))
        _entries[key] = compile_entry(decode if parallel else decode_serial, sig)
    _entries[parallel, dtype, id(recipe_t)] = (recipe_t, _entries[key])
    return _entries[key]


def key_bounds(r, is_causal, kv_lens, leftpad, lq):
    """``(lo, hi)``, int64 arrays (B,): the keys ``[lo[b], hi[b])`` that some query token of
    sequence ``b`` sees under recipe ``r`` (tokens at positions ``kv_lens[b] - lq ..
    kv_lens[b] - 1``) from ``leftpad[b]`` on: the keys a kernel reads. Host code, with the
    score seam's :func:`~sdpa_numba.score.recipe.key_range` (as the CPU kernel's plan)."""
    from .score.recipe import key_range

    if is_causal:
        r = r._replace(right=min(r.right, 0))
    lo = np.zeros(len(kv_lens), np.int64) if leftpad is None else leftpad.copy()
    hi = np.asarray(kv_lens, np.int64).copy()
    for b, n in enumerate(hi.tolist()):
        j_begin, j_end = key_range.py_func(r, n - lq, n - 1, n)
        lo[b] = max(j_begin, lo[b])
        hi[b] = max(j_end, lo[b])
    return lo, hi


def _host(name, x):
    """A small integer argument (``cache_seqlens``, ``block_table``) as a NumPy array, copied
    from the device if it is there."""
    if _is_device(x):
        from .gpu.arrays import adopt as adopt_device

        return adopt_device([(name, x)])[0][0].copy_to_host()
    return as_numpy(name, x)


def _run_cuda(q, k_cache, v_cache, k, v, pages, slots, table, kv_lens, bounds, r, is_causal,
              scale, out, out_shape, dtype, return_lse, restore):
    """The CUDA path, once everything is checked: append on the device, then decode."""
    from numba import cuda

    from .gpu.arrays import device_array
    from .gpu.decode import append, decode

    if pages is not None:
        append(k, v, k_cache, v_cache, pages, slots)
    result = device_array(out_shape, dtype) if out is None else out
    B, Lq, Hq, _ = out_shape
    lse = device_array((B, Hq, Lq), compute_dtype(dtype))
    decode(q, k_cache, v_cache, cuda.to_device(table), kv_lens, is_causal, scale, result, lse,
           bounds=bounds, recipe=r)
    result, lse = restore(result), restore(lse)
    return (result, lse) if return_lse else result


def _check_float(name, x, dtype=None):
    dt = np.dtype(x.dtype)
    if dt not in FLOATS and not is_bfloat16(dt):
        raise TypeError(f"{name} dtype {dt} is not supported: use float16, bfloat16 "
                        f"(ml_dtypes.bfloat16), float32 or float64")
    if dtype is not None and dt != dtype:
        raise TypeError(f"{name} dtype {dt} differs from q's dtype {dtype}")


def _check_ndim(name, x, nd, dims):
    if x.ndim != nd:
        raise ValueError(f"{name} must have {nd} dims {dims}, got shape {shape_str(x)}")


def _check_int(name, x):
    if np.dtype(x.dtype).kind not in "iu":
        raise TypeError(f"{name} must be an integer array, got dtype {np.dtype(x.dtype)}")


def attention_with_kvcache(q: Any, k_cache: Any, v_cache: Any, cache_seqlens: Any, *,
                           k: Any = None, v: Any = None, block_table: Any = None,
                           cache_leftpad: Any = None, is_causal: bool = True,
                           scale: float | None = None, return_lse: bool = False, out: Any = None,
                           window: Any = None, alignment: str = "bottom_right",
                           softcap: float | None = None, alibi_slopes: Any = None,
                           sinks: Any = None, score_mod: Any = None, mask_mod: Any = None,
                           mod_args: Any = (), block_mask: Any = None) -> Any:
    """Attention of new query tokens against a key/value cache (decode, chunked prefill,
    speculative decoding), with FlashAttention's ``flash_attn_with_kvcache`` layouts.

    Parameters
    ----------
    q : ndarray or CUDA array, shape (B, Lq, Hq, E)
        The new query tokens of each sequence: float16, bfloat16, float32 or float64. NumPy
        (or other host) arrays run on the CPU kernel, CUDA arrays on the CUDA kernel
        (:mod:`sdpa_numba.gpu.decode`); q, the caches, ``k``, ``v`` and ``out`` must all be
        on one side. The result comes back as q's kind of array.
    k_cache : ndarray, shape (B, S_max, H, E) or (num_pages, page_size, H, E)
        A contiguous cache, or with ``block_table`` a paged one (any ``page_size >= 1``).
        ``Hq`` must be a multiple of ``H`` (grouped-query attention: query head ``hq`` reads
        key/value head ``hq // (Hq // H)``). q's dtype; last dim contiguous.
    v_cache : ndarray, shape (B, S_max, H, Ev) or (num_pages, page_size, H, Ev)
    cache_seqlens : int or array of ints, shape (B,)
        Keys already in the cache for each sequence (host or device array: it is read on the
        host, to check it and to split the work).
    k, v : ndarray, shape (B, Lq_new, H, E) and (B, Lq_new, H, Ev), keyword-only, optional
        New keys and values, both or neither. They are written into the cache at positions
        ``cache_seqlens[b] .. cache_seqlens[b] + Lq_new - 1`` first (the one documented
        in-place update of an input; ``cache_seqlens`` itself is not changed), and attended
        to. An append that would overflow the cache is refused before anything is written.
    block_table : ndarray of int32, shape (B, max_pages), keyword-only, optional
        Paged cache: key ``j`` of sequence ``b`` is slot ``j % page_size`` of page
        ``block_table[b, j // page_size]``. The entries of the pages a sequence uses must be
        in ``[0, num_pages)`` (the rest are not read); sequences may share pages they read,
        but a page that receives appended keys must belong to one sequence alone.
    cache_leftpad : array of ints, shape (B,), keyword-only, optional
        Where each sequence's cache starts (FlashAttention's ``cache_leftpad``, for left-padded
        batches): keys ``j < cache_leftpad[b]`` of sequence ``b`` are neither read nor attended.
        Positions (causality, windows, ALiBi, score_mod's ``i`` and ``j``) stay the cache's:
        key ``j`` is at position ``j`` whatever the padding. ``0 <= cache_leftpad[b] <=
        cache_seqlens[b] + Lq_new``; equal to it, the sequence has no keys (zeros, lse -inf).
        Host or device array (read on the host). None: 0.
    is_causal : bool, keyword-only
        Bottom-right aligned (default True): with ``n = cache_seqlens[b] + Lq_new`` keys,
        query token ``t`` sees keys ``j <= n - Lq + t``, i.e. the cache and the new tokens up
        to its own position (chunked prefill, speculative decoding). False: every key.
    scale : float, keyword-only, optional
        Multiplies ``q · k``; default ``1 / sqrt(E)``. Must be finite.
    return_lse : bool, keyword-only
        Also return the log-sum-exp of each row's scores, shape ``(B, Hq, Lq)`` (FlashAttention's
        layout), in the compute dtype (float64 for float64, else float32).
    out : ndarray, shape (B, Lq, Hq, Ev), keyword-only, optional
        A buffer of q's dtype, written in place and returned.
    window : (left, right), keyword-only, optional
        Sliding window in the cache's frame: query token ``t`` sits at position ``i = n - Lq +
        t`` (``n = cache_seqlens[b] + Lq_new``) and sees keys ``i - left <= j <= i + right``
        (each side an int >= 0 or None: unlimited; with ``is_causal`` the right side is 0).
        Keys outside every token's window are not read: a decode step with ``window=(255,
        0)`` over a cache of 8192 keys reads 256 of them.
    alignment : "bottom_right", keyword-only
        The cache's frame is bottom-right aligned (as above), always: "top_left" is refused
        (a query token's place is fixed by the cache, not by a choice of frame).
    softcap : float > 0, keyword-only, optional
        Scores become ``softcap * tanh(score / softcap)`` (before ALiBi and score_mod).
    alibi_slopes : array, shape (Hq,) or (B, Hq), keyword-only, optional
        Subtracts ``slope[b, h] * |i - j|`` (positions as for ``window``); float32/float64.
    sinks : array, shape (Hq,), keyword-only, optional
        One logit per query head that joins every row's softmax denominator (no value row);
        ``-inf``: no sink for that head.
    score_mod, mask_mod : Numba @njit functions, keyword-only, optional
        ``score_mod(score, b, h, i, j, *mod_args) -> float`` and ``mask_mod(b, h, i, j,
        *mod_args) -> bool`` (True: the key takes part), compiled into the kernel (on CUDA
        arrays, as device functions). ``b`` is the batch index (the sequence), ``h`` the query
        head, ``i`` the query token's position in the cache's frame, ``n - Lq + t``, and ``j``
        the key's position in the cache (left padding does not shift it).
    mod_args : tuple, keyword-only, optional
        Extra arguments of score_mod / mask_mod (arrays on q's side, numbers).
    block_mask : None, keyword-only
        Refused (NotImplementedError): a block mask is made for one (L, S), while each
        sequence of a cache has its own length, growing at every step; use ``mask_mod``.

    Returns
    -------
    out : ndarray of q's dtype, shape (B, Lq, Hq, Ev)
    lse : ndarray, shape (B, Hq, Lq), only with ``return_lse=True``

    Raises
    ------
    TypeError, ValueError
        For bad input, naming the argument, before anything is read or written.
    NotImplementedError
        For ``block_mask``.

    Notes
    -----
    Each key/value row is read once per call for all the query heads of its group and all
    ``Lq`` tokens. Long sequences are split into chunks of keys computed in parallel and merged
    by lse (split-KV); the result is bitwise the same for any thread count. A sequence with no
    keys (or a token that sees none) gives zeros and ``lse = -inf``.
    """
    if block_mask is not None:
        raise NotImplementedError(
            "attention_with_kvcache does not take a block_mask: a block mask is made for one "
            "(L, S), while each sequence of the cache has its own length, growing at every "
            "step; pass its mask_mod instead")
    if isinstance(alignment, str) and alignment == "top_left":
        raise ValueError("attention_with_kvcache's alignment is 'bottom_right' (query token t "
                         "sits at position cache_seqlens[b] + Lq_new - Lq + t): 'top_left' "
                         "has no meaning for a cache")
    check_alignment(alignment)
    named = [("q", q), ("k_cache", k_cache), ("v_cache", v_cache), ("k", k), ("v", v),
             ("out", out)]
    for name in ("q", "k_cache", "v_cache"):
        if dict(named)[name] is None:
            raise TypeError(f"{name} must be an array, got None")
    on_device = [name for name, x in named if x is not None and _is_device(x)]
    device = "cuda" if on_device else "host"
    if on_device and len(on_device) != sum(x is not None for _, x in named):
        raise TypeError(f"inputs mix host and device arrays ({', '.join(on_device)} on the "
                        f"device): put q, the caches, k, v and out on one device")
    if (k is None) != (v is None):
        raise ValueError("k and v must be given together (new keys and values), or neither")
    is_causal = check_flag("is_causal", is_causal)
    return_lse = check_flag("return_lse", return_lse)
    appending = k is not None
    if isinstance(cache_seqlens, numbers.Integral) and not isinstance(cache_seqlens, bool):
        cache_seqlens = np.full(np.shape(q)[:1], int(cache_seqlens), np.int64)
    # cache_seqlens and block_table are read on the host (checks, and the split into chunks),
    # whichever device they are on.
    cache_seqlens = _host("cache_seqlens", cache_seqlens)
    if cache_leftpad is not None:
        cache_leftpad = _host("cache_leftpad", cache_leftpad)
    block_table = None if block_table is None else _host("block_table", block_table)
    if device == "cuda":
        from .gpu.arrays import adopt as adopt_device

        arrays, restore = adopt_device([("q", q), ("k_cache", k_cache), ("v_cache", v_cache),
                                        ("k", k), ("v", v)], out)
        q, k_cache, v_cache, k, v = arrays[:5]
        for name, x in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache), ("k", k),
                        ("v", v)):
            if x is not None and any(st < 0 for st in x.strides):
                raise ValueError(f"{name} has negative strides {tuple(x.strides)}, which the "
                                 f"CUDA path does not support: pass a copy")
    else:
        # The caches are adopted without a copy: they may be written, and must be read as is.
        k_cache = as_numpy("k_cache", k_cache, writable=appending)
        v_cache = as_numpy("v_cache", v_cache, writable=appending)
        arrays, restore = adopt_host([("q", q), ("k", k), ("v", v)], out)
        q, k, v = arrays[:3]
    out = arrays[-1] if out is not None else None

    _check_ndim("q", q, 4, "(B, Lq, Hq, E)")
    _check_float("q", q)
    dtype = np.dtype(q.dtype)
    paged = block_table is not None
    dims = "(num_pages, page_size, H, E)" if paged else "(B, S_max, H, E)"
    _check_ndim("k_cache", k_cache, 4, dims)
    _check_ndim("v_cache", v_cache, 4, dims.replace("E)", "Ev)"))
    _check_float("k_cache", k_cache, dtype)
    _check_float("v_cache", v_cache, dtype)
    B, Lq, Hq, E = q.shape
    n_pages, page_size, H, Ek = k_cache.shape
    leftpad = None
    Ev = v_cache.shape[3]
    if Ek != E:
        raise ValueError(f"k_cache's last dim must equal q's: q {shape_str(q)}, k_cache "
                         f"{shape_str(k_cache)}")
    if v_cache.shape[:3] != k_cache.shape[:3]:
        raise ValueError(f"v_cache's first three dims must equal k_cache's: k_cache "
                         f"{shape_str(k_cache)}, v_cache {shape_str(v_cache)}")
    if H == 0 or Hq % H:
        raise ValueError(f"q's heads ({Hq}) must be a multiple of the cache's heads ({H}): q "
                         f"{shape_str(q)}, k_cache {shape_str(k_cache)}")
    for name, c in (("k_cache", k_cache), ("v_cache", v_cache)):
        itemsize = np.dtype(c.dtype).itemsize
        if c.size and c.shape[3] > 1 and c.strides[3] != itemsize:  # (empty: any strides)
            raise ValueError(f"{name}'s last dim must be contiguous (stride {itemsize} "
                             f"bytes), got strides {tuple(c.strides)}")
    if not paged and n_pages != B:
        raise ValueError(f"a contiguous k_cache must have q's batch size {B} as its first dim, "
                         f"got {shape_str(k_cache)} (pass block_table for a paged cache)")

    _check_int("cache_seqlens", cache_seqlens)
    if cache_seqlens.shape != (B,):
        raise ValueError(f"cache_seqlens must have shape ({B},) (q's batch), got "
                         f"{shape_str(cache_seqlens)}")
    seqlens = cache_seqlens.astype(np.int64)
    if B and seqlens.min() < 0:
        raise ValueError(f"cache_seqlens must be >= 0, got {cache_seqlens}")

    lq_new = 0
    if appending:
        _check_ndim("k", k, 4, "(B, Lq_new, H, E)")
        _check_ndim("v", v, 4, "(B, Lq_new, H, Ev)")
        _check_float("k", k, dtype)
        _check_float("v", v, dtype)
        lq_new = k.shape[1]
        if k.shape != (B, lq_new, H, E) or v.shape != (B, lq_new, H, Ev):
            raise ValueError(f"k and v must have shapes (B, Lq_new, H, E) = "
                             f"({B}, {lq_new}, {H}, {E}) and (B, Lq_new, H, Ev) = "
                             f"({B}, {lq_new}, {H}, {Ev}), got {shape_str(k)} and "
                             f"{shape_str(v)}")
    kv_lens = seqlens + lq_new
    if cache_leftpad is not None:
        _check_int("cache_leftpad", cache_leftpad)
        if cache_leftpad.shape != (B,):
            raise ValueError(f"cache_leftpad must have shape ({B},) (q's batch), got "
                             f"{shape_str(cache_leftpad)}")
        leftpad = cache_leftpad.astype(np.int64)
        bad = (leftpad < 0) | (leftpad > kv_lens)
        if bad.any():
            b = int(np.argmax(bad))
            raise ValueError(f"cache_leftpad[{b}] = {leftpad[b]} must be in [0, "
                             f"cache_seqlens[{b}] + Lq_new] = [0, {kv_lens[b]}]")

    if paged:
        _check_ndim("block_table", block_table, 2, "(B, max_pages)")
        _check_int("block_table", block_table)
        if block_table.shape[0] != B:
            raise ValueError(f"block_table must have q's batch size {B} as its first dim, "
                             f"got {shape_str(block_table)}")
        capacity = block_table.shape[1] * page_size
    else:
        capacity = page_size  # S_max
    if B and kv_lens.max() > capacity:
        b = int(np.argmax(kv_lens))
        what = (f"cache_seqlens[{b}] + Lq_new = {seqlens[b]} + {lq_new}" if appending
                else f"cache_seqlens[{b}] = {seqlens[b]}")
        raise ValueError(f"{what} is beyond the cache's {capacity} slots per sequence"
                         + (" (max_pages * page_size)" if paged else " (S_max)"))
    if paged:
        n_used = -(-kv_lens // page_size) if page_size else np.zeros_like(kv_lens)
        used = np.arange(block_table.shape[1])[None, :] < n_used[:, None]
        entries = block_table[used]
        if entries.size and (entries.min() < 0 or entries.max() >= n_pages):
            bad = entries[(entries < 0) | (entries >= n_pages)][0]
            raise ValueError(f"block_table has entry {bad} among the pages in use, outside "
                             f"[0, {n_pages}) (num_pages of the cache)")
        if appending and lq_new:
            # A page written to must be used by its sequence alone, once: the append must not
            # change what another sequence (or another slot of the same one) reads.
            first_written = seqlens // page_size
            written = used & (np.arange(block_table.shape[1])[None, :] >= first_written[:, None])
            counts = np.bincount(entries.astype(np.int64), minlength=n_pages)
            shared = counts[block_table[written].astype(np.int64)] > 1
            if shared.any():
                raise ValueError(f"the append would write into page "
                                 f"{block_table[written][shared][0]}, which block_table lists "
                                 f"more than once among the pages in use (shared pages are "
                                 f"read-only)")
        table = np.ascontiguousarray(block_table, dtype=np.int32)
    else:
        table = np.arange(B, dtype=np.int32).reshape(B, 1)

    scale = check_scale(scale, E)
    # Positions go to the kernels in the cache's frame (offset 0): top-left is that frame.
    r = variants_recipe((B,), Hq, Lq, Lq, compute_dtype(dtype), is_causal, window=window,
                        alignment="top_left", softcap=softcap, alibi_slopes=alibi_slopes,
                        sinks=sinks, score_mod=score_mod, mask_mod=mask_mod,
                        mod_args=mod_args)

    out_shape = (B, Lq, Hq, Ev)
    if out is not None:
        if device == "cuda":
            from .gpu.arrays import address as device_address

            address = device_address
        else:
            address = host_address
        if tuple(out.shape) != out_shape or np.dtype(out.dtype) != dtype:
            raise ValueError(f"out must have shape {out_shape} and dtype {dtype}, got "
                             f"{shape_str(out)} {np.dtype(out.dtype)}")
        itemsize = np.dtype(out.dtype).itemsize
        if out.size and (any(s == 0 and n > 1 for s, n in zip(out.strides, out.shape))
                         or may_self_overlap(out.shape, out.strides, itemsize)):
            raise ValueError(f"out's elements overlap each other (strides "
                             f"{tuple(out.strides)}): pass a buffer of its own")
        for name, x in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache), ("k", k),
                        ("v", v)):
            if x is not None and may_overlap(out, x, address):
                raise ValueError(f"out overlaps {name}: pass a separate buffer")

    # Everything is checked: append, then attend.
    pages = slots = None
    if appending and lq_new and B:
        bidx = np.repeat(np.arange(B), lq_new)
        pos = (seqlens[:, None] + np.arange(lq_new)[None, :]).ravel()
        if paged:
            pages, slots = table[bidx, pos // page_size], pos % page_size
        else:
            pages, slots = bidx, pos
    bounds = key_bounds(r, is_causal, kv_lens, leftpad, Lq)
    if device == "cuda":
        return _run_cuda(q, k_cache, v_cache, k, v, pages, slots, table, kv_lens, bounds, r,
                         is_causal, scale, out, out_shape, dtype, return_lse, restore)
    if pages is not None:
        k_cache[pages, slots] = k.reshape(B * lq_new, H, E)
        v_cache[pages, slots] = v.reshape(B * lq_new, H, Ev)

    from .cpu.storage import storage_view

    result = np.empty(out_shape, dtype) if out is None else out
    lse = np.empty((B, Hq, Lq), compute_dtype(dtype))
    if result.size or lse.size:
        from .cpu.launch import recipe_type

        work = int((bounds[1] - bounds[0]).sum()) * H * (E + Ev) * dtype.itemsize
        args = (storage_view(q), storage_view(k_cache), storage_view(v_cache), table, kv_lens,
                is_causal, scale, storage_view(result), lse, r, bounds[0])
        if work >= SERIAL_BYTES:
            # The parallel kernel whatever the thread count: which kernel runs depends on the
            # shape only, so a result cannot change with the thread count (the serial and the
            # parallel kernel may round the last bit differently when loaded from the cache).
            with kernel_launch():
                _entry(True, dtype, recipe_type(r))(*args)
        else:  # on the calling thread: no thread pool to start or guard
            check_jit()
            _entry(False, dtype, recipe_type(r))(*args)
    result, lse = restore(result), restore(lse)
    return (result, lse) if return_lse else result
