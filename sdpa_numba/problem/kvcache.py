"""The validated key/value-cache problem of one decode step: :func:`kvcache_problem` checks
the operands of :func:`sdpa_numba.attention_with_kvcache` and returns a
:class:`KVCacheProblem`, which the decode launchers of both targets read
(:mod:`sdpa_numba.cpu.launch_decode`, :mod:`sdpa_numba.gpu.launch_decode`).

Everything that depends only on the shapes, the dtype, the layout (contiguous or paged), the
cache lengths, the left padding, the variants and the scale is checked and worked out here,
once: the recipe, the block table, the keys each sequence reads (:func:`key_bounds`) and the
slots an append writes. A step's layers share all of that (each has its own q, caches, new
keys and values, out: the same shapes, dtypes and lengths), so a problem serves every layer
of a step; :func:`check_arrays` is the cheap test that a layer's arrays are the ones it was
made for.

Works on shapes, strides and dtypes alone (host or device arrays); the integer arguments
(``cache_seqlens``, ``cache_leftpad``, ``block_table``) come as NumPy arrays.
"""

from dataclasses import dataclass

import numpy as np

from ..score.recipe import key_range
from .arguments import check_flag, check_scale, shape_str
from .dtypes import check_storage_dtype, compute_dtype
from .out import given_arrays
from .quant import check_scales, quant_spec
from .rope import rope_problem
from .variant_table import host_array
from .variants import check_alignment, variants_recipe
from .varlen import check_cu_seqlens, check_max_seqlen, host_ints


def key_bounds_loop(key_range, first_key, rows_of):
    """The one rule of the keys a sequence's kernel reads, as a function ``bounds(r, kv_lens,
    kv_begin, lq, lo, hi)`` that writes ``lo[b]``, ``hi[b]``: the keys ``[lo[b], hi[b])``
    that some query token of sequence ``b`` sees under recipe ``r`` (causality folded in;
    tokens at positions ``kv_lens[b] - lq .. kv_lens[b] - 1``, or for a ragged batch where
    :func:`query_rows` puts them), from ``first_key(kv_begin, b)`` on (the left padding).

    Built with the score seam's ``key_range``, a ``first_key`` and a ``rows_of`` (the rule of
    :func:`query_rows`): on the host with their Python forms (:func:`key_bounds`), in the CPU
    kernel compiled with the jitted ones (:func:`sdpa_numba.cpu.decode._plan`), so that the
    host's bounds (the CUDA launch's chunks, the CPU launch's choice of kernel) and the CPU
    kernel's are the same rule.
    """

    def bounds(r, kv_lens, kv_begin, lq, lo, hi):
        n_seq = len(kv_lens)
        for b in range(n_seq):
            n = kv_lens[b]
            _, _, lq_b, i0, off = rows_of(kv_begin, n_seq, b, n, lq)
            j_begin, j_end = key_range(r, i0 + off, i0 + off + lq_b - 1, n)
            lo[b] = max(j_begin, first_key(kv_begin, b))
            hi[b] = max(j_end, lo[b])
            if lq_b == 0:  # a sequence of a ragged batch without query rows reads nothing
                hi[b] = lo[b]

    return bounds


def _first_key(kv_begin, b):
    return 0 if kv_begin is None else kv_begin[b]


def query_rows(kv_begin, n_seq, b, kv_len, lq):
    """``(qb, q0, lq_b, i0, off)`` of sequence ``b`` (of ``n_seq``): its query rows are
    ``q[qb, q0 .. q0 + lq_b - 1]``, the first at position ``i0`` (token ``t`` at ``i0 + t``:
    what ``score_mod`` / ``mask_mod`` see as ``i``), and the recipe's offset is moved by
    ``off`` for it (windows, causality, chunks and ALiBi see ``i + off``). The decode
    kernels' ``kv_begin`` carries them: of ``n_seq`` entries (or None), the left padding
    alone and a rectangular batch, ``(b, 0, lq, kv_len - lq, 0)``: the tokens are the
    sequence's last (bottom-right, the cache's frame); of ``6 * n_seq``, a ragged batch's
    table (:func:`ragged_table`). The host's form (the kernels compile their own of this
    rule, :func:`sdpa_numba.cpu.decode.query_rows`)."""
    if kv_begin is None or len(kv_begin) == n_seq:
        return b, 0, lq, kv_len - lq, 0
    x = kv_begin
    return (x[n_seq + b], x[2 * n_seq + b], x[3 * n_seq + b], x[4 * n_seq + b],
            x[5 * n_seq + b])


def ragged_table(kv_begin, cu_q, kv_lens, sequence_frame=False, bottom_right=True):
    """The decode kernels' ``kv_begin`` of a ragged batch (:func:`query_rows`), int64 ``(6 *
    B,)``: the first key of each sequence (``kv_begin``, None: 0), then for the packed query
    rows ``cu_q`` (int64 ``(B + 1,)``, rows of a ``(1, total_q, ..)`` view): batch index 0,
    first row ``cu_q[b]``, rows ``lq_b``, and the frame. The cache's frame
    (``attention_with_kvcache``): token ``t`` at position ``kv_len - lq_b + t``, offset 0.
    The sequence's frame (``varlen_attention`` over a cache): token ``t`` at ``t``, offset
    ``kv_len - lq_b`` with ``bottom_right``, else 0 (as varlen's per-sequence recipe)."""
    n_seq = len(kv_lens)
    lq = np.diff(cu_q).astype(np.int64)
    kv_lens = np.asarray(kv_lens, np.int64)
    begin = np.zeros(n_seq, np.int64) if kv_begin is None else np.asarray(kv_begin, np.int64)
    zero = np.zeros(n_seq, np.int64)
    if sequence_frame:
        i0, off = zero, (kv_lens - lq if bottom_right else zero)
    else:
        i0, off = kv_lens - lq, zero
    return np.ascontiguousarray(np.concatenate(
        [begin, zero, np.asarray(cu_q[:-1], np.int64), lq, i0, off]))


# (key_range itself where NUMBA_DISABLE_JIT leaves it a plain function)
_host_bounds = key_bounds_loop(getattr(key_range, "py_func", key_range), _first_key,
                               query_rows)


def key_bounds(r, is_causal, kv_lens, leftpad, lq):
    """``(lo, hi)``, int64 arrays (B,): the keys ``[lo[b], hi[b])`` that some query token of
    sequence ``b`` sees under recipe ``r`` (tokens at positions ``kv_lens[b] - lq ..
    kv_lens[b] - 1``, or for a ragged batch's table in ``leftpad`` (:func:`ragged_table`)
    where it puts them) from ``leftpad[b]`` on: the keys a kernel reads
    (:func:`key_bounds_loop`'s rule, on the host)."""
    if is_causal:
        r = r._replace(right=min(r.right, 0))
    kv_lens = np.asarray(kv_lens, np.int64)
    lo = np.empty(len(kv_lens), np.int64)
    hi = np.empty(len(kv_lens), np.int64)
    _host_bounds(r, kv_lens.tolist(), None if leftpad is None else leftpad.tolist(), lq,
                 lo, hi)
    return lo, hi


@dataclass(frozen=True, eq=False)
class KVCacheProblem:
    """One decode step's problem after validation (see the module).

    Shapes: ``q_shape (B, Lq, Hq, E)``; ``k_cache_shape`` / ``v_cache_shape`` ``(num_pages,
    page_size, H, E / Ev)`` (a contiguous cache ``(B, S_max, H, ..)`` is ``B`` pages of
    ``S_max`` slots); ``k_shape`` / ``v_shape`` ``(B, Lq_new, H, E / Ev)`` of an append, or
    None. ``table``: int32 ``(B, max_pages)``, the block table (contiguous: ``[[0], [1],
    ..]``). ``seqlens``: the keys in the cache before the append; ``kv_lens``: after it
    (int64). ``lo``, ``hi``: :func:`key_bounds`. ``pages``, ``slots``: where row ``n`` of the
    appended keys (``k`` as ``(B * Lq_new, H, E)``) goes, or None.
    """

    q_shape: tuple
    k_cache_shape: tuple
    v_cache_shape: tuple
    k_shape: tuple | None
    v_shape: tuple | None
    dtype: np.dtype
    compute_dtype: np.dtype
    paged: bool
    table: np.ndarray
    seqlens: np.ndarray
    kv_lens: np.ndarray
    leftpad: np.ndarray | None
    lo: np.ndarray
    hi: np.ndarray
    pages: np.ndarray | None
    slots: np.ndarray | None
    is_causal: bool
    scale: float
    recipe: object
    out_shape: tuple
    lse_shape: tuple
    #: The call's other arrays as given (ALiBi slopes, sinks, mod_args arrays, the cache
    #: lengths, block table, left padding), which ``out`` may not overlap
    #: (:func:`sdpa_numba.problem.out.given_arrays`).
    given: tuple = ()
    #: A quantized cache's format (:class:`sdpa_numba.problem.quant.QuantSpec`), or None.
    quant: object = None
    #: The rotation of q and the new keys (:class:`sdpa_numba.problem.rope.RopeProblem`), or
    #: None.
    rope: object = None
    #: A ragged batch (``cu_seqlens_q``): its cumulative query rows, int64 (B + 1,); None for
    #: q of shape (B, Lq, Hq, E).
    cu_q: np.ndarray | None = None
    #: The kernels' ``kv_begin`` of a ragged batch (:func:`ragged_table`, its first keys
    #: ``lo``); None: ``lo``.
    begin: np.ndarray | None = None
    #: The sequence of each appended row (``pages``, ``slots``), or None.
    append_b: np.ndarray | None = None

    @property
    def n_seq(self):
        """The batch's sequences, B."""
        return len(self.kv_lens)

    @property
    def appending(self):
        """Whether the step appends new keys and values (``k`` and ``v`` given)."""
        return self.k_shape is not None

    @property
    def read_bytes(self):
        """Bytes of keys and values the kernels read."""
        h, e = self.k_cache_shape[2:]
        ev = self.v_cache_shape[3]
        per_key = ((e + ev) * self.dtype.itemsize if self.quant is None
                   else e + ev + self.quant.scale_bytes(e, ev))
        return int((self.hi - self.lo).sum()) * h * per_key


def _check_ndim(name, x, nd, dims):
    if x.ndim != nd:
        raise ValueError(f"{name} must have {nd} dims {dims}, got shape {shape_str(x)}")


def _check_int(name, x):
    if np.dtype(x.dtype).kind not in "iu":
        raise TypeError(f"{name} must be an integer array, got dtype {np.dtype(x.dtype)}")


def _check_cache_strides(name, c):
    """The kernels read a cache's last dim at unit stride."""
    itemsize = c.dtype.itemsize
    if c.shape[3] > 1 and c.strides[3] != itemsize and c.size:  # (empty: any strides)
        raise ValueError(f"{name}'s last dim must be contiguous (stride {itemsize} bytes), "
                         f"got strides {tuple(c.strides)}")


def check_writeable(named):
    """Arrays that will be written (the caches of an append) must be writeable: ValueError
    naming the first that is not (NumPy's flag; device arrays have none)."""
    for name, x in named:
        if isinstance(x, np.ndarray) and not x.flags.writeable:
            raise ValueError(f"{name} must be writeable: the append writes the new keys and "
                             f"values into k_cache and v_cache")


def kvcache_problem(q, k_cache, v_cache, cache_seqlens, k, v, block_table, cache_leftpad,
                    is_causal, scale, *, alignment="bottom_right", k_scale=None, v_scale=None,
                    cache_batch_idx=None, rotary_cos=None, rotary_sin=None,
                    rotary_interleaved=False, cu_seqlens_q=None, sequence_frame=None,
                    **variants):
    """Validate one decode step's operands and return its :class:`KVCacheProblem`.

    ``q``, the caches, ``k`` and ``v`` (None: no append): the target's arrays (anything with
    ``shape``, ``strides``, ``ndim`` and a NumPy ``dtype``); ``cache_seqlens`` (B,),
    ``block_table`` and ``cache_leftpad`` (None or arrays): NumPy arrays; ``variants``: the
    variants the KV-cache functions take (:mod:`.variant_table`); ``k_scale``, ``v_scale``: a
    quantized cache's scales (:mod:`.quant`), arrays of the caches' kind; ``cache_batch_idx``
    (None or a NumPy array) the cache row of each sequence of a contiguous cache;
    ``rotary_cos``, ``rotary_sin`` (None or NumPy arrays) and ``rotary_interleaved`` the
    rotation (:mod:`.rope`); ``cu_seqlens_q`` (None or an array, read on the host) a ragged
    batch: ``q`` ``(total_q, Hq, E)``, ``k`` and ``v`` ``(total_q, H, E / Ev)``, sequence
    ``b`` the rows ``cu_seqlens_q[b] .. cu_seqlens_q[b + 1] - 1``; ``sequence_frame`` (None:
    the cache's frame, tokens at the sequence's last positions) True or False: the frame of
    ``varlen_attention`` over a cache (:func:`ragged_table`), bottom-right aligned or not.
    Raises TypeError / ValueError naming the argument, as documented by
    :func:`sdpa_numba.attention_with_kvcache`.
    """
    if isinstance(alignment, str) and alignment == "top_left":
        raise ValueError("attention_with_kvcache's alignment is 'bottom_right' (query token t "
                         "sits at position cache_seqlens[b] + Lq_new - Lq + t): 'top_left' "
                         "has no meaning for a cache")
    check_alignment(alignment)
    if (k is None) != (v is None):
        raise ValueError("k and v must be given together (new keys and values), or neither")
    is_causal = check_flag("is_causal", is_causal)
    appending = k is not None

    ragged = cu_seqlens_q is not None
    if ragged:
        _check_ndim("q", q, 3, "(total_q, Hq, E) with cu_seqlens_q")
    else:
        _check_ndim("q", q, 4, "(B, Lq, Hq, E)")
    dtype = check_storage_dtype("q", q)
    paged = block_table is not None
    dims = "(num_pages, page_size, H, E)" if paged else "(B, S_max, H, E)"
    _check_ndim("k_cache", k_cache, 4, dims)
    _check_ndim("v_cache", v_cache, 4, dims.replace("E)", "Ev)"))
    if ragged:
        total_q, Hq, E = q.shape
        cu_q = check_cu_seqlens("cu_seqlens_q", cu_seqlens_q, total_q, "q")
        B = len(cu_q) - 1
        lqs = np.diff(cu_q)
        Lq = int(lqs.max()) if B else 0
    else:
        B, Lq, Hq, E = q.shape
        cu_q = None
    quant = quant_spec(k_cache, v_cache, k_scale, v_scale, B)
    if quant is None:
        check_storage_dtype("k_cache", k_cache, ("q's", dtype))
        check_storage_dtype("v_cache", v_cache, ("q's", dtype))
    n_pages, page_size, H, Ek = k_cache.shape
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
    _check_cache_strides("k_cache", k_cache)
    _check_cache_strides("v_cache", v_cache)
    if cache_batch_idx is not None and paged:
        raise ValueError("cache_batch_idx selects rows of a contiguous cache; with block_table "
                         "(a paged cache) give each sequence its pages in block_table instead")
    if not paged and cache_batch_idx is None and n_pages != B:
        raise ValueError(f"a contiguous k_cache must have q's batch size {B} as its first dim, "
                         f"got {shape_str(k_cache)} (pass block_table for a paged cache, or "
                         f"cache_batch_idx to pick its rows)")

    _check_int("cache_seqlens", cache_seqlens)
    if cache_seqlens.shape != (B,):
        raise ValueError(f"cache_seqlens must have shape ({B},) (q's batch), got "
                         f"{shape_str(cache_seqlens)}")
    seqlens = cache_seqlens.astype(np.int64)
    if B and seqlens.min() < 0:
        raise ValueError(f"cache_seqlens must be >= 0, got {cache_seqlens}")

    lq_new = 0
    new = np.zeros(B, np.int64)  # the appended keys of each sequence
    if appending and ragged:
        _check_ndim("k", k, 3, "(total_q, H, E) with cu_seqlens_q")
        _check_ndim("v", v, 3, "(total_q, H, Ev) with cu_seqlens_q")
        check_storage_dtype("k", k, ("q's", dtype))
        check_storage_dtype("v", v, ("q's", dtype))
        if k.shape != (total_q, H, E) or v.shape != (total_q, H, Ev):
            raise ValueError(f"with cu_seqlens_q, k and v must have shapes (total_q, H, E) = "
                             f"({total_q}, {H}, {E}) and (total_q, H, Ev) = ({total_q}, {H}, "
                             f"{Ev}) (each sequence's new keys are its query tokens), got "
                             f"{shape_str(k)} and {shape_str(v)}")
        new = lqs
        lq_new = int(lqs.max()) if B else 0
    elif appending:
        _check_ndim("k", k, 4, "(B, Lq_new, H, E)")
        _check_ndim("v", v, 4, "(B, Lq_new, H, Ev)")
        check_storage_dtype("k", k, ("q's", dtype))
        check_storage_dtype("v", v, ("q's", dtype))
        lq_new = k.shape[1]
        if k.shape != (B, lq_new, H, E) or v.shape != (B, lq_new, H, Ev):
            raise ValueError(f"k and v must have shapes (B, Lq_new, H, E) = "
                             f"({B}, {lq_new}, {H}, {E}) and (B, Lq_new, H, Ev) = "
                             f"({B}, {lq_new}, {H}, {Ev}), got {shape_str(k)} and "
                             f"{shape_str(v)}")
        new = np.full(B, lq_new, np.int64)
    kv_lens = seqlens + new
    leftpad = None
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
                             f"cache_seqlens[{b}] + Lq_new] = [0, {kv_lens[b]}]"
                             + (" (Lq_new: the sequence's rows in cu_seqlens_q)"
                                if ragged and appending else ""))

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
        what = (f"cache_seqlens[{b}] + Lq_new = {seqlens[b]} + {new[b]}" if appending
                else f"cache_seqlens[{b}] = {seqlens[b]}")
        if sequence_frame is not None:
            what = f"seqused_k[{b}] = {seqlens[b]}"
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
            if ragged:  # a sequence without new keys writes no page
                written &= (new > 0)[:, None]
            counts = np.bincount(entries.astype(np.int64), minlength=n_pages)
            shared = counts[block_table[written].astype(np.int64)] > 1
            if shared.any():
                raise ValueError(f"the append would write into page "
                                 f"{block_table[written][shared][0]}, which block_table lists "
                                 f"more than once among the pages in use (shared pages are "
                                 f"read-only)")
        # A copy of the caller's table: a problem stays valid whatever they do with theirs.
        table = np.array(block_table, dtype=np.int32, order="C")
    elif cache_batch_idx is not None:
        # Sequence b reads (and appends into) cache row cache_batch_idx[b]: the contiguous
        # cache as pages of S_max slots, with that row as the sequence's one page.
        _check_int("cache_batch_idx", cache_batch_idx)
        if cache_batch_idx.shape != (B,):
            raise ValueError(f"cache_batch_idx must have shape ({B},) (q's batch), got "
                             f"{shape_str(cache_batch_idx)}")
        idx = cache_batch_idx.astype(np.int64)
        bad = (idx < 0) | (idx >= n_pages)
        if bad.any():
            b = int(np.argmax(bad))
            raise ValueError(f"cache_batch_idx[{b}] = {idx[b]} is outside [0, {n_pages}) (the "
                             f"cache's first dim)")
        if appending and lq_new and len(np.unique(idx)) < B:
            vals, counts = np.unique(idx, return_counts=True)
            raise ValueError(f"cache_batch_idx lists cache row {vals[counts > 1][0]} more than "
                             f"once: an append would write the same slots from two sequences "
                             f"(rows may be shared only without k and v)")
        table = idx.astype(np.int32).reshape(B, 1)
    else:
        table = np.arange(B, dtype=np.int32).reshape(B, 1)

    window = variants.get("window")
    per_token = (is_causal or variants.get("chunk") is not None
                 or not (window is None or tuple(window) == (None, None)))
    if ragged and (rotary_cos is not None or rotary_sin is not None):
        rope = _ragged_rope(rotary_cos, rotary_sin, rotary_interleaved, E, seqlens, cu_q,
                            appending, per_token)
    else:
        rope = rope_problem(rotary_cos, rotary_sin, rotary_interleaved, E, seqlens, Lq,
                            lq_new if appending else None, per_token)
    scale = check_scale(scale, E)
    # Positions go to the kernels in the cache's frame (offset 0): top-left is that frame.
    r = variants_recipe((B,), Hq, Lq, Lq, compute_dtype(dtype), is_causal,
                        alignment="top_left", **variants)

    pages = slots = bidx = None
    if appending and ragged and int(new.sum()):
        bidx = np.repeat(np.arange(B), lqs)
        pos = seqlens[bidx] + (np.arange(total_q) - cu_q[bidx])
        if paged:
            pages, slots = table[bidx, pos // page_size], pos % page_size
        else:
            pages, slots = table[bidx, 0].astype(np.int64), pos
    elif appending and lq_new and B and not ragged:
        bidx = np.repeat(np.arange(B), lq_new)
        pos = (seqlens[:, None] + np.arange(lq_new)[None, :]).ravel()
        if paged:
            pages, slots = table[bidx, pos // page_size], pos % page_size
        else:
            pages, slots = table[bidx, 0].astype(np.int64), pos
    begin = None
    if ragged:
        frame = (sequence_frame is not None, bool(sequence_frame))
        lo, hi = key_bounds(r, is_causal, kv_lens, ragged_table(leftpad, cu_q, kv_lens, *frame),
                            Lq)
        begin = ragged_table(lo, cu_q, kv_lens, *frame)
        out_shape, lse_shape = (total_q, Hq, Ev), (Hq, total_q)
    else:
        lo, hi = key_bounds(r, is_causal, kv_lens, leftpad, Lq)
        out_shape, lse_shape = (B, Lq, Hq, Ev), (B, Hq, Lq)
    return KVCacheProblem(
        q_shape=tuple(q.shape), k_cache_shape=tuple(k_cache.shape),
        v_cache_shape=tuple(v_cache.shape),
        k_shape=tuple(k.shape) if appending else None,
        v_shape=tuple(v.shape) if appending else None, dtype=dtype,
        compute_dtype=compute_dtype(dtype), paged=paged, table=table, seqlens=seqlens,
        kv_lens=kv_lens, leftpad=leftpad, lo=lo, hi=hi, pages=pages, slots=slots,
        is_causal=is_causal, scale=scale, recipe=r, out_shape=out_shape,
        lse_shape=lse_shape, quant=quant, rope=rope, cu_q=cu_q, begin=begin, append_b=bidx,
        given=given_arrays(variants, cache_seqlens=cache_seqlens, block_table=block_table,
                           cache_leftpad=cache_leftpad, cache_batch_idx=cache_batch_idx,
                           rotary_cos=rotary_cos, rotary_sin=rotary_sin,
                           cu_seqlens_q=cu_seqlens_q))


def _ragged_rope(cos, sin, interleaved, E, seqlens, cu_q, appending, per_token):
    """The rotation of a ragged batch, as :func:`.rope.rope_problem`'s with each token its own
    sequence of one row (rows ``(total_q, 1, rotary_dim / 2)``, for q and k seen as
    ``(total_q, 1, H, E)``): new key / token ``t`` of sequence ``b`` at ``cache_seqlens[b] +
    t``; query tokens at ``cache_seqlens[b]`` when not ``per_token``."""
    from dataclasses import replace

    b_of = np.repeat(np.arange(len(seqlens)), np.diff(cu_q))
    pos = seqlens[b_of] + (np.arange(int(cu_q[-1])) - cu_q[b_of])
    keys = rope_problem(cos, sin, interleaved, E, pos, 1, 1 if appending else None, True)
    if keys is None or per_token:
        return keys
    first = rope_problem(cos, sin, interleaved, E, seqlens[b_of], 1, 1, True)
    return replace(keys, q_pos=first.q_pos, q_cos=first.q_cos, q_sin=first.q_sin)


def _mismatch(name, x, expect, dtype):
    return ValueError(f"{name} of shape {shape_str(x)} and dtype {np.dtype(x.dtype)} is not "
                      f"what the plan was made for: shape {expect} and dtype {dtype} (a plan "
                      f"serves arrays of one shape and dtype; make one for these)")


def check_arrays(p, q, k_cache, v_cache, k, v, k_scale=None, v_scale=None):
    """The cheap test, before a run of problem ``p``, that these arrays are ones it was made
    for: the shapes and dtypes it was checked with, the caches' last dim contiguous, ``k`` and
    ``v`` given exactly when it appends, a quantized cache's scales
    (:func:`.quant.check_scales`), and then the caches (and per-token scales) writeable.
    Shapes fix everything else the problem checked (a cache's slots, its pages, the append's
    slots stay in it). TypeError / ValueError naming the argument."""
    dtype = p.dtype
    cdt = dtype if p.quant is None else p.quant.cache_dtype
    if not (q.shape == p.q_shape and k_cache.shape == p.k_cache_shape
            and v_cache.shape == p.v_cache_shape and q.dtype == dtype
            and k_cache.dtype == cdt and v_cache.dtype == cdt):
        for name, x, expect, dt in (("q", q, p.q_shape, dtype),
                                    ("k_cache", k_cache, p.k_cache_shape, cdt),
                                    ("v_cache", v_cache, p.v_cache_shape, cdt)):
            if x.shape != expect or x.dtype != dt:
                raise _mismatch(name, x, expect, dt)
    appending = p.k_shape is not None
    if (k is None) == appending or (v is None) == appending:
        raise ValueError("k and v must be given exactly when the plan was made with them (an "
                         "append of new keys and values), got "
                         + ("neither" if k is None and v is None else "one of them"
                            if k is None or v is None else "both")
                         + f" for a plan {'with' if appending else 'without'} them")
    if appending:
        for name, x, expect in (("k", k, p.k_shape), ("v", v, p.v_shape)):
            if x.shape != expect or x.dtype != dtype:
                raise _mismatch(name, x, expect, dtype)
    if p.quant is not None:
        check_scales(p.quant, k_scale, v_scale, k, v)
    elif k_scale is not None or v_scale is not None:
        raise ValueError(f"{'k_scale' if k_scale is not None else 'v_scale'} is for a "
                         f"quantized cache; this plan's cache is {dtype}")
    itemsize = cdt.itemsize
    if k_cache.strides[3] != itemsize or v_cache.strides[3] != itemsize:
        _check_cache_strides("k_cache", k_cache)
        _check_cache_strides("v_cache", v_cache)
    if appending:
        check_writeable((("k_cache", k_cache), ("v_cache", v_cache)))
        if p.quant is not None and not p.quant.fp8:
            check_writeable((("k_scale", k_scale), ("v_scale", v_scale)))


# --- varlen_attention over a cache (block_table, seqused_k) ---------------------------------

def _cu_lengths(name, x, n_seq):
    """An optional ``cu_seqlens_k`` given with ``block_table`` (lengths only, FlashAttention
    2's paged varlen): int64 (B + 1,), from 0, never decreasing; its last entry is free."""
    a = host_ints(name, x)
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
        used = host_ints("seqused_k", seqused_k)
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
        check_max_seqlen("max_seqlen_q", max_seqlen_q, np.diff(cu_q))
    if max_seqlen_k is not None:
        check_max_seqlen("max_seqlen_k", max_seqlen_k, used)
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


def cache_rows(table, lengths, page_size):
    """The flat slot (``page * page_size + slot``) of each key a ragged batch reads through
    ``table`` (int, ``(B, max_pages)``): sequence ``b``'s first ``lengths[b]`` keys, the
    sequences back to back (int64, ``sum(lengths)`` rows)."""
    rows = [table[b, np.arange(n) // page_size].astype(np.int64) * page_size
            + np.arange(n) % page_size for b, n in enumerate(np.asarray(lengths, np.int64))]
    return np.concatenate(rows) if rows else np.zeros(0, np.int64)
