"""``attention_with_kvcache``: new query tokens against a key/value cache, contiguous or paged,
with an optional in-place append of the new keys and values, left padding and the attention
variants (FlashAttention's ``flash_attn_with_kvcache`` layouts); ``kvcache_plan``: the same
step planned once and run for every layer of a model (FlashInfer's ``plan()`` / ``run()``).

A call is a plan and a run. The plan (:func:`sdpa_numba.problem.kvcache.kvcache_problem`)
checks and works out everything that depends on the shapes, dtype, layout, cache lengths,
left padding, variants and scale; the run checks that its arrays are the plan's (shapes,
dtype, the caches' strides, writeable caches for an append), checks ``out``
(:func:`sdpa_numba.problem.check_out`) and hands the arrays to the target's decode launcher
(:mod:`sdpa_numba.cpu.launch_decode`, :mod:`sdpa_numba.gpu.launch_decode`). Everything is
validated before anything is written: a bad argument leaves the cache untouched.
"""

import numbers
from typing import Any

import numpy as np

from .host_arrays import as_numpy
from .problem.arguments import check_flag
from .problem.kvcache import check_arrays, key_bounds, kvcache_problem
from .problem.out import check_out
from .problem.quant import quant_kind
from .problem.variant_table import VARIANTS, check_names, takes_variants
from .targets import CUDA, HOST, is_device_array, target_of

__all__ = ["attention_with_kvcache", "kvcache_plan", "KVCachePlan", "key_bounds"]

_REQUIRED = ("q", "k_cache", "v_cache")


def _host(name, x):
    """A small integer argument (``cache_seqlens``, ``block_table``) as a NumPy array, copied
    from the device if it is there."""
    if is_device_array(x):
        return CUDA.to_host(CUDA.adopt([(name, x)])[0][0])
    return as_numpy(name, x)


def _scale(name, x, writable, target=HOST):
    """A quantized cache's scale as an array of ``target`` (a Python number: a float32
    scalar; a number or a 0-d NumPy array is copied to the device for CUDA)."""
    if x is None:
        return None
    if isinstance(x, numbers.Real) and not isinstance(x, bool):
        x = np.array(x, np.float32)
        if target is HOST:
            return x
    if target is CUDA:
        if isinstance(x, np.ndarray) and x.ndim == 0:  # a host scalar: as a number
            from numba import cuda

            return cuda.to_device(x)  # (CUDA.from_host would make it 1-d)
        if not is_device_array(x):
            raise TypeError(f"{name} is a {type(x).__name__}, but the caches are CUDA arrays: "
                            f"pass the scales as CUDA arrays too (a float for an fp8 "
                            f"descale)")
        return CUDA.adopt([(name, x)])[0][0]
    return as_numpy(name, x, writable=writable)


def _adopt(q, k_cache, v_cache, k, v, out, k_scale=None, v_scale=None):
    """``(target, [q, k_cache, v_cache, k, v, out, k_scale, v_scale], restore)``: the operands
    as the target's arrays, without copies (the caches and scales may be written, and must be
    read as they are)."""
    named = [("q", q), ("k_cache", k_cache), ("v_cache", v_cache), ("k", k), ("v", v)]
    target = target_of([*named, ("out", out)], required=_REQUIRED)
    if target is CUDA:
        arrays, restore = CUDA.adopt(named, out)
        arrays = list(arrays)
        CUDA.check_strides(list(zip(("q", "k_cache", "v_cache", "k", "v"), arrays)))
    else:
        appending = k is not None
        k_cache = as_numpy("k_cache", k_cache, writable=appending)
        v_cache = as_numpy("v_cache", v_cache, writable=appending)
        adopted, restore = HOST.adopt([("q", q), ("k", k), ("v", v)], out)
        arrays = [adopted[0], k_cache, v_cache, adopted[1], adopted[2]]
        if out is not None:
            arrays.append(adopted[3])
    if out is None:
        arrays.append(None)
    # Written by an append into an int8 cache (its per-token or q8_0 scales), so never copies.
    w = k is not None and quant_kind(arrays[1].dtype) == "int8"
    arrays += [_scale("k_scale", k_scale, w, target), _scale("v_scale", v_scale, w, target)]
    return target, arrays, restore


def _plan(target, q, k_cache, v_cache, cache_seqlens, k, v, block_table, cache_leftpad,
          is_causal, scale, variants, k_scale=None, v_scale=None, rotary=None,
          cu_seqlens_q=None, sequence_frame=None):
    if cu_seqlens_q is not None:
        if is_device_array(cu_seqlens_q):  # read on the host (checked by the problem)
            cu_seqlens_q = _host("cu_seqlens_q", cu_seqlens_q)
        shape = np.shape(cu_seqlens_q)
        n_seq = max(shape[0] - 1, 0) if len(shape) == 1 else 0
    else:
        n_seq = q.shape[0]
    if isinstance(cache_seqlens, numbers.Integral) and not isinstance(cache_seqlens, bool):
        cache_seqlens = np.full((n_seq,), int(cache_seqlens), np.int64)
    # cache_seqlens, cache_leftpad and block_table are read on the host (checks, and the split
    # into chunks), whichever device they are on.
    cache_seqlens = _host("cache_seqlens", cache_seqlens)
    if cache_leftpad is not None:
        cache_leftpad = _host("cache_leftpad", cache_leftpad)
    if block_table is not None:
        block_table = _host("block_table", block_table)
    # The rotation and the cache rows: read on the host (the rotation's table rows are
    # gathered once per step, for every layer).
    cos, sin, interleaved, batch_idx = rotary or (None, None, False, None)
    if batch_idx is not None:
        batch_idx = _host("cache_batch_idx", batch_idx)
    # Tables on the device stay there for a CUDA step (its rows are gathered on the device);
    # the rest are read on the host.
    cos, sin = (None if x is None else CUDA.adopt([(name, x)])[0][0]
                if target is CUDA and is_device_array(x) else _host(name, x)
                for name, x in (("rotary_cos", cos), ("rotary_sin", sin)))
    p = kvcache_problem(q, k_cache, v_cache, cache_seqlens, k, v, block_table, cache_leftpad,
                        is_causal, scale, k_scale=k_scale, v_scale=v_scale,
                        cache_batch_idx=batch_idx, rotary_cos=cos, rotary_sin=sin,
                        rotary_interleaved=interleaved, cu_seqlens_q=cu_seqlens_q,
                        sequence_frame=sequence_frame, **variants)
    return KVCachePlan(p, target, target.prepare_decode(p))


#: The variants the KV-cache functions do not take (TypeError), and their own defaults.
_NOT_TAKEN = tuple(v.name for v in VARIANTS if not v.kvcache)
_DEFAULTS = {"alignment": "bottom_right"}


def _check_variants(func, variants, target):
    """TypeError for a keyword that is not a variant the KV-cache functions take;
    NotImplementedError for one ``target`` does not run, and for a ``block_mask`` (taken out
    of ``variants``)."""
    check_names(func, variants, exclude=_NOT_TAKEN, target=target)
    if variants.pop("block_mask", None) is not None:
        raise NotImplementedError(
            "attention_with_kvcache does not take a block_mask: a block mask is made for one "
            "(L, S), while each sequence of the cache has its own length, growing at every "
            "step; pass its mask_mod instead")


class KVCachePlan:
    """One decode step planned once, run for every layer: made by :func:`kvcache_plan`.

    Attributes
    ----------
    problem : sdpa_numba.problem.kvcache.KVCacheProblem
        The validated step: shapes, dtype, cache lengths, block table, key bounds, recipe.
    target : sdpa_numba.targets.HOST or sdpa_numba.targets.CUDA
        Where its runs go: the kind of arrays it was made with.

    Notes
    -----
    A plan is for one step. With ``k`` and ``v`` it appends at ``cache_seqlens[b] ..
    cache_seqlens[b] + Lq_new - 1`` of each layer's cache; the next step has ``Lq_new`` more
    keys per sequence and needs a plan of its own. A second append by one plan into the same
    cache (the same ``k_cache`` buffer) is refused: it would write the same slots again
    instead of the next ones.
    """

    __slots__ = ("problem", "target", "_launch", "_appended")

    def __init__(self, problem, target, launch):
        self.problem = problem
        self.target = target
        self._launch = launch
        self._appended = set()

    def __repr__(self):
        p = self.problem
        new = p.k_shape[0 if p.cu_q is not None else 1] if p.appending else None
        return (f"KVCachePlan(q {p.q_shape}, k_cache {p.k_cache_shape}, "
                f"{'paged, ' if p.paged else ''}dtype {p.dtype}, "
                f"{'no append' if new is None else f'append {new}'}, "
                + (f"ragged ({p.n_seq} sequences), " if p.cu_q is not None else "")
                + (f"rotary_dim {p.rope.rotary_dim}"
                   f"{' interleaved' if p.rope.interleaved else ''}, " if p.rope else "")
                + f"on {self.target.name})")

    def run(self, q: Any, k_cache: Any, v_cache: Any, *, k: Any = None, v: Any = None,
            out: Any = None, return_lse: bool = False, k_scale: Any = None,
            v_scale: Any = None) -> Any:
        """Attention of one layer's new query tokens against its cache, as planned.

        Parameters
        ----------
        q : array, shape (B, Lq, Hq, E)
        k_cache, v_cache : arrays, the plan's shapes
            This layer's caches, of the kind (host or CUDA), shapes and dtype the plan was
            made with; their last dim contiguous.
        k, v : arrays, shapes (B, Lq_new, H, E) and (B, Lq_new, H, Ev), keyword-only
            This layer's new keys and values: exactly when the plan was made with them.
            Written into the cache first (see :func:`attention_with_kvcache`); the caches
            must be writeable.
        out : array, shape (B, Lq, Hq, Ev), keyword-only, optional
            A buffer of q's dtype, written in place and returned.
        return_lse : bool, keyword-only
            Also return the log-sum-exp, shape (B, Hq, Lq), in the compute dtype.
        k_scale, v_scale : arrays, keyword-only
            This layer's scales of a quantized cache (exactly when the plan's cache is one):
            the plan's shapes and dtype (see :func:`attention_with_kvcache`).

        Returns
        -------
        out, lse : arrays
            What :func:`attention_with_kvcache` returns for these arrays (``lse`` only with
            ``return_lse=True``).

        Raises
        ------
        TypeError, ValueError
            For arrays that are not the plan's (another kind, shape, dtype, a cache whose
            last dim is strided, a read-only cache to append to, a second append into one
            cache) or a bad ``out``, naming the argument, before anything is written.
        """
        if not (self.target is HOST and type(q) is np.ndarray and type(k_cache) is np.ndarray
                and type(v_cache) is np.ndarray and (k is None or type(k) is np.ndarray)
                and (v is None or type(v) is np.ndarray)
                and (out is None or type(out) is np.ndarray)
                and (k_scale is None or type(k_scale) is np.ndarray)
                and (v_scale is None or type(v_scale) is np.ndarray)):
            target, arrays, restore = _adopt(q, k_cache, v_cache, k, v, out, k_scale, v_scale)
            if target is not self.target:
                raise TypeError(f"this plan was made for {self.target.name} arrays, got "
                                f"{target.name} arrays: make a plan with these")
            q, k_cache, v_cache, k, v, out, k_scale, v_scale = arrays
            result = self._run(q, k_cache, v_cache, k, v, out, return_lse, k_scale, v_scale)
            return (restore(result[0]), restore(result[1])) if return_lse \
                else restore(result)
        return self._run(q, k_cache, v_cache, k, v, out, return_lse, k_scale, v_scale)

    def _run(self, q, k_cache, v_cache, k, v, out, return_lse, k_scale=None, v_scale=None):
        """:meth:`run` on the target's arrays."""
        return_lse = check_flag("return_lse", return_lse)
        p = self.problem
        check_arrays(p, q, k_cache, v_cache, k, v, k_scale, v_scale)
        if out is not None:
            check_out(p, out, (("q", q), ("k_cache", k_cache), ("v_cache", v_cache),
                               ("k", k), ("v", v)), self.target.address)
        if p.pages is not None:
            where = self.target.address(k_cache)
            if where in self._appended:
                raise ValueError("this plan has already appended into this k_cache: a plan "
                                 "is for one step (the next one has Lq_new more keys per "
                                 "sequence); make a plan for the next step")
            self._appended.add(where)
        if p.quant is None:
            result, lse = self._launch(q, k_cache, v_cache, k, v, out)
        else:
            result, lse = self._launch(q, k_cache, v_cache, k, v, out, k_scale, v_scale)
        return (result, lse) if return_lse else result


@takes_variants(exclude=_NOT_TAKEN, defaults=_DEFAULTS)
def kvcache_plan(q: Any, k_cache: Any, v_cache: Any, cache_seqlens: Any, *, k: Any = None,
                 v: Any = None, block_table: Any = None, cache_leftpad: Any = None,
                 is_causal: bool = True, scale: float | None = None, k_scale: Any = None,
                 v_scale: Any = None, rotary_cos: Any = None, rotary_sin: Any = None,
                 rotary_interleaved: bool = False, cache_batch_idx: Any = None,
                 cu_seqlens_q: Any = None, **variants: Any) -> KVCachePlan:
    """Plan one decode step once, for every layer of a model: the checks and the work of
    :func:`attention_with_kvcache` that depend only on shapes, dtype, layout, cache lengths,
    left padding, variants and scale, done now; each layer then calls
    :meth:`KVCachePlan.run` with its own arrays.

    Parameters
    ----------
    q, k_cache, v_cache : arrays
        One layer's arrays (say the first's), as for :func:`attention_with_kvcache`: they
        give the shapes, the dtype and the target; they are read for their shapes only and
        not kept.
    cache_seqlens, block_table, cache_leftpad : keyword-only except cache_seqlens
        As for :func:`attention_with_kvcache`; copied (a plan stays valid whatever is done
        to them afterwards).
    k, v : arrays, keyword-only, optional
        One layer's new keys and values: given, every run appends (and must be given its own
        ``k`` and ``v`` of these shapes).
    cu_seqlens_q : array of ints, shape (B + 1,), keyword-only, optional
        A ragged batch, as for :func:`attention_with_kvcache`; copied.
    rotary_cos, rotary_sin, rotary_interleaved, cache_batch_idx : keyword-only, optional
        As for :func:`attention_with_kvcache`: part of the step (the same for its layers).
        The table rows the step's tokens use are copied now, and every run rotates its own
        q and k with them; the cache rows are copied too.

    Other Parameters
    ----------------
    is_causal, scale, k_scale, v_scale, window, chunk, alignment, softcap, alibi_slopes, sinks, score_mod, mask_mod, mod_args, block_mask : as for attention_with_kvcache
        As for :func:`attention_with_kvcache` (``k_scale``, ``v_scale``: one layer's, for
        their shapes and dtype; each run passes its own).

    Returns
    -------
    KVCachePlan
        ``plan.run(q, k_cache, v_cache, k=None, v=None, out=None, return_lse=False)`` for
        each layer: what ``attention_with_kvcache`` returns for those arrays, bit for bit.

    Raises
    ------
    TypeError, ValueError, NotImplementedError
        As :func:`attention_with_kvcache`, for the arguments it is given.

    Notes
    -----
    A plan is for one step: with ``k`` and ``v``, the next step's cache lengths are
    ``cache_seqlens + Lq_new``, and it needs a new plan (a second append by one plan into the
    same cache is refused). A run still checks what differs from layer to layer, cheaply:
    the kind of arrays, their shapes and dtype, the caches' last-dim stride, writeable caches
    for an append, and ``out``.

    Examples
    --------
    >>> plan = sdpa_numba.kvcache_plan(q[0], k_caches[0], v_caches[0], lens)  # doctest: +SKIP
    >>> outs = [plan.run(q[i], k_caches[i], v_caches[i]) for i in range(n_layers)]  # doctest: +SKIP
    """
    target, (q, k_cache, v_cache, k, v, _, k_scale, v_scale), _ = _adopt(
        q, k_cache, v_cache, k, v, None, k_scale, v_scale)
    _check_variants("kvcache_plan", variants, target)
    return _plan(target, q, k_cache, v_cache, cache_seqlens, k, v, block_table, cache_leftpad,
                 is_causal, scale, variants, k_scale, v_scale,
                 (rotary_cos, rotary_sin, rotary_interleaved, cache_batch_idx), cu_seqlens_q)


@takes_variants(exclude=_NOT_TAKEN, defaults=_DEFAULTS)
def attention_with_kvcache(q: Any, k_cache: Any, v_cache: Any, cache_seqlens: Any, *,
                           k: Any = None, v: Any = None, block_table: Any = None,
                           cache_leftpad: Any = None, is_causal: bool = True,
                           scale: float | None = None, return_lse: bool = False, out: Any = None,
                           k_scale: Any = None, v_scale: Any = None, rotary_cos: Any = None,
                           rotary_sin: Any = None, rotary_interleaved: bool = False,
                           cache_batch_idx: Any = None, cu_seqlens_q: Any = None,
                           **variants: Any) -> Any:
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
    k_scale, v_scale : arrays or floats, keyword-only, optional
        The scales of a quantized cache (:mod:`sdpa_numba.quant`), which the kernel reads
        and dequantizes with (``k ~ k_cache * k_scale``); the format follows from the
        caches' dtype and the scales' shape. int8 caches: float32 or float16 scales of
        shape ``(N, S, H)`` (``"int8"``, one per token and head) or ``(N, S, H, E // 32)``
        (``"q8_0"``, one per 32 values along the head dim; ``E`` and ``Ev`` multiples of
        32), ``(N, S)`` the caches' first two dims. ``float8_e4m3fn`` / ``float8_e5m2``
        caches (ml_dtypes): a descale, a float or a float32 array of shape () or ``(B,
        H)`` (FlashAttention 3's ``k_descale``). Finite. An append quantizes ``k`` and
        ``v`` into the cache (round to nearest even, saturating) and, for int8 caches,
        writes their scales (:func:`sdpa_numba.quant.quantize_kv`'s rule); fp8 descales
        are kept. q of any float dtype. With CUDA caches the scales are CUDA arrays too
        (an fp8 descale may be a float or a 0-d NumPy array).
    rotary_cos, rotary_sin : arrays, shape (seqlen_ro, rotary_dim / 2), keyword-only, optional
        Rotary position embedding on append (FlashAttention's): q and the new keys ``k`` are
        rotated before the attention and the append (so the cache receives rotated keys);
        both or neither, and only with ``k`` and ``v`` (as FlashAttention). ``rotary_dim``
        even, ``<= E``: the first ``rotary_dim`` dims of each head rotate, the rest pass
        through. New key ``i`` of sequence ``b`` is at position ``cache_seqlens[b] + i`` (its
        cache slot; left padding does not shift it); query token ``t`` at
        ``cache_seqlens[b] + t`` when ``is_causal`` or a ``window`` / ``chunk`` is given,
        else every query token at ``cache_seqlens[b]``. Row ``p`` of the tables is position
        ``p``: ``seqlen_ro`` must exceed every position used. Any float dtype. Host tables
        are read on the host and only the rows in use copied; CUDA tables of a CUDA call
        stay on the device (the rows in use are gathered there). The rotation is done in
        float64 and rounded once to q's dtype, into scratch: q and k are not modified.
    rotary_interleaved : bool, keyword-only
        False (default; GPT-NeoX / Llama style): dims ``i`` and ``i + rotary_dim / 2`` rotate
        together. True (GPT-J style): dims ``2i`` and ``2i + 1``. (FlashAttention's default
        is True.)
    cache_batch_idx : array of ints, shape (B,), keyword-only, optional
        The row of a contiguous cache (``(N, S_max, H, E)``, any ``N``) that sequence ``b``
        reads and appends into: ``cache_batch_idx[b]``, in ``[0, N)``; distinct when
        appending (rows may repeat without ``k`` and ``v``). Not with ``block_table``
        (ValueError: a paged cache's sequences pick their pages there). Read on the host.
    cu_seqlens_q : array of ints, shape (B + 1,), keyword-only, optional
        A ragged (mixed) batch: chunked prefill and decode of many sequences in one launch
        (vLLM's and SGLang's batches; FlashAttention 3's ``cu_seqlens_q``). ``q`` is then
        ``(total_q, Hq, E)``, sequence ``b`` its rows ``cu_seqlens_q[b] ..
        cu_seqlens_q[b + 1] - 1`` (``Lq_b`` of them, 0 allowed), ``k`` and ``v`` (if given)
        ``(total_q, H, E)`` and ``(total_q, H, Ev)``, the same rows: each sequence's new
        keys are its query tokens, appended at ``cache_seqlens[b] .. cache_seqlens[b] +
        Lq_b - 1``. Everything else as above with ``Lq`` and ``Lq_new`` per sequence
        (``Lq_b``): token ``t`` of sequence ``b`` sits at position ``n_b - Lq_b + t``, ``n_b
        = cache_seqlens[b] (+ Lq_b when appending)``. ``out`` ``(total_q, Hq, Ev)``, ``lse``
        ``(Hq, total_q)`` (varlen's layout). Starts at 0, never decreases, ends at
        ``total_q``; read on the host. Equal, bit for bit, to one call per sequence with its
        rows as ``q[None]``. One compiled kernel with the rectangular calls (the rows are a
        run-time table). With ``rotary_cos`` / ``rotary_sin``, token ``t`` of sequence ``b``
        and its new key rotate at ``cache_seqlens[b] + t`` (the query tokens at
        ``cache_seqlens[b]`` when not causal and without a window or chunk, as above).
        CUDA arrays run the CUDA twin (the partial results then take ``Hq * max(Lq_b)`` rows
        per chunk of keys).

    Other Parameters
    ----------------
    window : (left, right), keyword-only, optional
        Sliding window in the cache's frame: query token ``t`` sits at position ``i = n - Lq +
        t`` (``n = cache_seqlens[b] + Lq_new``) and sees keys ``i - left <= j <= i + right``
        (each side an int >= 0 or None: unlimited; with ``is_causal`` the right side is 0).
        Keys outside every token's window are not read: a decode step with ``window=(255,
        0)`` over a cache of 8192 keys reads 256 of them.
    chunk : int >= 1, keyword-only, optional
        Chunked local attention (Llama 4's ``attention_chunk``) in the cache's frame, as
        ``window``: query token ``t`` at position ``i = n - Lq + t`` sees only keys ``j`` with
        ``i // chunk == j // chunk`` (key ``j`` at position ``j``, left padding included).
        Keys outside every token's chunk are not read. None: no chunks.
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
        ``(total_q, Hq, Ev)`` with ``cu_seqlens_q``.
    lse : ndarray, shape (B, Hq, Lq), only with ``return_lse=True``
        ``(Hq, total_q)`` with ``cu_seqlens_q``.

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
    target, (q, k_cache, v_cache, k, v, out, k_scale, v_scale), restore = _adopt(
        q, k_cache, v_cache, k, v, out, k_scale, v_scale)
    _check_variants("attention_with_kvcache", variants, target)
    return_lse = check_flag("return_lse", return_lse)
    plan = _plan(target, q, k_cache, v_cache, cache_seqlens, k, v, block_table, cache_leftpad,
                 is_causal, scale, variants, k_scale, v_scale,
                 (rotary_cos, rotary_sin, rotary_interleaved, cache_batch_idx), cu_seqlens_q)
    result, lse = plan._run(q, k_cache, v_cache, k, v, out, True, k_scale, v_scale)
    result, lse = restore(result), restore(lse)
    return (result, lse) if return_lse else result
