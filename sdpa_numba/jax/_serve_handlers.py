"""The XLA FFI handlers of the serving functions: the packed (varlen) forward and backward
(:func:`sdpa_numba.cpu.varlen.varlen_forward`, ``varlen_backward``) and the KV-cache decode
(:func:`sdpa_numba.cpu.decode.decode` / ``decode_serial``) with its append, as Numba
``@cfunc`` functions that read XLA's call frame (:mod:`._frame`), with no Python on the call
path.

One handler per storage dtype (and for the KV cache, append or not), made on first use and
kept for the process (:func:`._handlers._target`). Shapes are read from the frame's buffers.
The integer arguments the NumPy API checks on the host (``cu_seqlens``, ``cache_seqlens``,
``block_table``, ``cache_leftpad``) are traced values under ``jax.jit``: their values are
checked here, before anything is computed or written, and a bad one fails the call with an
XLA error naming it (:func:`._frame.error`), which JAX raises to the caller.

Operands are XLA's row-major dense buffers. The varlen handlers loop over any leading dims
(``jax.vmap``'s, with ``vmap_method="broadcast_all"``: every operand has them); the KV-cache
handler takes none.
"""

import numpy as np
from numba import carray, njit

from ..cpu.storage import load
from ..score.recipe import kernel_recipe, recipe
from ._frame import (answer_metadata, argument, as_pointer, c_string, data, dims, error,
                     load_i64, ranked, result)
from ._handlers import _native_call, _storage, _target

_S64 = 5  # XLA_FFI_DataType_S64 (S32 is 4): the integer operands come as either


def _messages(*texts):
    """``(table, offsets)``: the NUL-terminated ``texts`` back to back in one uint8 array, and
    where each starts: a handler fails with ``error(frame, table[offsets[i]:])`` (one frozen
    array of one type, whichever message)."""
    parts = [c_string(t) for t in texts]
    offsets = np.cumsum([0] + [len(p) for p in parts[:-1]]).astype(np.int64)
    return np.concatenate(parts), tuple(int(o) for o in offsets)


@njit
def _size(d, first, last):
    n = 1
    for i in range(first, last):
        n *= d[i]
    return n


@njit
def _ints_at(buffer, o, n):
    """Entries ``o * n .. o * n + n - 1`` of an int32 or int64 buffer, as an int64 array."""
    if (load_i64(buffer + 16) & 0xFFFFFFFF) == _S64:
        return carray(as_pointer(data(buffer) + 8 * o * n), (n,), np.int64).copy()
    return carray(as_pointer(data(buffer) + 4 * o * n), (n,), np.int32).astype(np.int64)


@njit
def _numbers(frame, i_ints, n_ints, i_floats, n_floats):
    """The ``ints`` (int64) and ``floats`` (scale, softcap; float64) operands, carried as
    uint32 bytes (JAX without ``jax_enable_x64`` has no 64-bit arrays)."""
    return (carray(as_pointer(data(argument(frame, i_ints))), (n_ints,), np.int64),
            carray(as_pointer(data(argument(frame, i_floats))), (n_floats,), np.float64))


def _recipe_maker(mods, first):
    """A jitted ``make(frame, idx, left, right, chunk, softcap, alibi, sinks)``: the recipe of
    ALiBi slopes and sinks (each None or a C-contiguous array of the compute dtype, as the
    NumPy API's) and of the user's functions ``mods`` (None, or :func:`._mods.mod_operands`'s
    ``(score_mod, mask_mod, score_mod_grad, specs)``) with their ``mod_args`` read from
    operands ``first`` on at outer batch indices ``idx`` (:func:`._handlers._mod_args_getter`).
    No block mask: the serving functions' NumPy API builds none (each sequence has its own
    shape). Without any optional part: the plain recipe
    (:data:`sdpa_numba.cpu.launch.PLAIN_RECIPE`)."""
    from ._handlers import _mod_args_getter

    score_mod, mask_mod, score_mod_grad, specs = mods if mods is not None else (
        None, None, None, ())
    get_args = _mod_args_getter(first, specs)

    @njit
    def make(frame, idx, left, right, chunk, softcap, alibi, sinks):
        return recipe(left=left, right=right, chunk=chunk, softcap=softcap, alibi=alibi,
                      sinks=sinks, score_mod=score_mod, mask_mod=mask_mod,
                      score_mod_grad=score_mod_grad, mod_args=get_args(frame, idx))

    return make


@njit
def _lead_index(d, nb, o):
    """The indices of flat leading index ``o`` in dims ``d[:nb]`` (``vmap``'s), row-major."""
    idx = np.empty(nb, np.int64)
    for i in range(nb - 1, -1, -1):
        idx[i] = o % d[i]
        o //= d[i]
    return idx


_tail_views = {}


@njit
def _tail(buffer, o, nd, itemsize):
    """``(address, dims, rank)``: the address of leading index ``o`` of ``buffer``'s last
    ``nd`` dims (a row-major buffer: the leading dims flattened), its dims and rank."""
    d = dims(buffer)
    n = d.shape[0]
    return data(buffer) + o * itemsize * _size(d, n - nd, n), d, n


_VIEW_SOURCE = """
def view(buffer, o):
    a, d, r = _tail(buffer, o, {nd}, size)
    return carray(as_pointer(a), ({last}), np_type)
"""


def _tail_view(np_type, nd):
    """A jitted ``view(buffer, o)``: the C-contiguous ``nd``-dim array of ``np_type``
    over ``buffer``'s last ``nd`` dims at leading index ``o`` (``vmap``'s dims flattened;
    0 without them): the one view of the serving handlers' operands and results."""
    key = (np.dtype(np_type), nd)
    if key in _tail_views:
        return _tail_views[key]
    view = ranked(_VIEW_SOURCE, nd, _tail=_tail, carray=carray, as_pointer=as_pointer,
                  size=np.dtype(np_type).itemsize, np_type=np_type)
    _tail_views[key] = view
    return view


def _per_head(ct, alibi, sinks, i_alibi):
    """Jitted ``(frame, o) -> alibi`` and ``-> sinks``: the operands ``i_alibi`` on (ALiBi
    slopes ``(B or 1, Hq)``, sinks ``(Hq,)``, compute dtype) at leading index ``o``, or None
    where the specialization has none."""
    a2, a1 = _tail_view(ct, 2), _tail_view(ct, 1)
    i_sinks = i_alibi + bool(alibi)

    @njit
    def get_alibi(frame, o):
        return a2(argument(frame, i_alibi), o)

    @njit
    def get_sinks(frame, o):
        return a1(argument(frame, i_sinks), o)

    @njit
    def none(frame, o):
        return None

    return get_alibi if alibi else none, get_sinks if sinks else none


# ---------------------------------------------------------------- varlen

_CU_START, _CU_DECREASE, _CU_END, _MAX = 1, 2, 3, 4


@njit
def _check_cu(cu, total, max_len):
    """0 when ``cu`` starts at 0, never decreases and ends at ``total`` and no sequence is
    longer than ``max_len`` (< 0: no limit); else the failure's code."""
    if cu[0] != 0:
        return _CU_START
    for b in range(cu.shape[0] - 1):
        if cu[b + 1] < cu[b]:
            return _CU_DECREASE
        if max_len >= 0 and cu[b + 1] - cu[b] > max_len:
            return _MAX
    if cu[cu.shape[0] - 1] != total:
        return _CU_END
    return 0


#: ints of a varlen call: is_causal, bottom_right, left, right, chunk, max_seqlen_q,
#: max_seqlen_k (-1: not given), dropout's threshold; floats: scale, softcap, inv_keep
VARLEN_INTS, VARLEN_FLOATS = 8, 3


def _varlen_dropout(dropout, i_seed):
    """A jitted ``(frame, ints, floats, o) -> dropout``: the kernels' dropout tuple of
    leading index ``o`` (the seed operand ``i_seed``, two uint32 words low first, broadcast
    by ``vmap`` like every operand; batch offset 0: each index's sequences count from 0, as
    the unmapped call's), or for ``dropout`` False the forward's None / the backward's
    "off" tuple (``off``)."""
    @njit
    def on(frame, ints, floats, o, off):
        seed = carray(as_pointer(data(argument(frame, i_seed)) + 8 * o), (1,), np.uint64)[0]
        return (seed, np.uint64(ints[7]), floats[2], np.int64(0))

    @njit
    def not_on(frame, ints, floats, o, off):
        return off

    return on if dropout else not_on


def _varlen_common(dtype):
    """Views of one leading index of the varlen operands, and the cu_seqlens check."""
    from ..problem.dtypes import compute_dtype

    st = _storage(dtype)
    ct = compute_dtype(dtype).type
    texts, at = _messages(*[
        f"sdpa_numba.jax.varlen_attention: {m}" for name, what in
        (("cu_seqlens_q", "q"), ("cu_seqlens_k", "k")) for m in (
            f"{name} must start at 0", f"{name} must not decrease",
            f"{name} must end at {what}'s total rows",
            f"max_seqlen_{what} is smaller than the longest sequence of {name}")],
        "sdpa_numba.jax.varlen_attention: cu_seqlens_q and cu_seqlens_k must hold the same "
        "number of sequences")
    at = np.array(at, np.int64)

    st3, ct3, ct2 = _tail_view(st, 3), _tail_view(ct, 3), _tail_view(ct, 2)

    @njit
    def cu_seqlens(frame, o, ints, total_q, total_k):
        """``(cu_q, cu_k, fail)`` of leading index ``o``: ``fail`` < 0 when they pass the
        NumPy API's checks, else the offset of the error's message in ``texts``."""
        bq, bk = argument(frame, 3), argument(frame, 4)
        dq, dk = dims(bq), dims(bk)
        nq, nk = dq[dq.shape[0] - 1], dk[dk.shape[0] - 1]
        cu_q, cu_k = _ints_at(bq, o, nq), _ints_at(bk, o, nk)
        code = _check_cu(cu_q, total_q, ints[5])
        if code:
            return cu_q, cu_k, at[code - 1]
        code = _check_cu(cu_k, total_k, ints[6])
        if code:
            return cu_q, cu_k, at[code + 3]
        if nq != nk:
            return cu_q, cu_k, at[8]
        return cu_q, cu_k, np.int64(-1)

    @njit
    def fail(frame, offset):
        return error(frame, texts[offset:])

    return ct, st3, ct3, ct2, cu_seqlens, fail


def _make_varlen_forward(dtype, alibi=False, sinks=False, dropout=False, mods=None):
    """The varlen forward's cfunc: operands q, k, v, cu_seqlens_q, cu_seqlens_k, ints,
    floats, [ALiBi slopes], [sinks], [dropout's seed], [mod_args]; results out (q's dtype),
    lse (compute dtype, ``(.., Hq, total_q)``)."""
    from ..cpu.launch_varlen import forward_signature
    from ..cpu.varlen import varlen_forward
    from ._handlers import _recipe_type

    ct, st3, ct3, ct2, cu_seqlens, fail = _varlen_common(dtype)
    kernel = _native_call(varlen_forward, forward_signature(
        np.dtype(dtype), dropout, _recipe_type(ct, alibi, sinks, mods, block_mask=False)))
    get_alibi, get_sinks = _per_head(ct, alibi, sinks, 7)
    get_drop = _varlen_dropout(dropout, 7 + alibi + sinks)
    make_recipe = _recipe_maker(mods, 7 + alibi + sinks + dropout)
    failed = c_string("sdpa_numba.jax: the CPU varlen forward failed (out of memory?)")

    def handler(frame):
        if answer_metadata(frame):
            return 0
        ints, floats = _numbers(frame, 5, VARLEN_INTS, 6, VARLEN_FLOATS)
        qd, kd = dims(argument(frame, 0)), dims(argument(frame, 1))
        nb = qd.shape[0] - 3
        n_outer = _size(qd, 0, nb)
        total_q, hq, total_k = qd[nb], qd[nb + 1], kd[nb]
        for o in range(n_outer):  # every check first: nothing is computed on bad input
            _, _, bad = cu_seqlens(frame, o, ints, total_q, total_k)
            if bad >= 0:
                return fail(frame, bad)
        if total_q * hq == 0:
            return 0
        try:
            for o in range(n_outer):
                cu_q, cu_k, _ = cu_seqlens(frame, o, ints, total_q, total_k)
                r = make_recipe(frame, _lead_index(qd, nb, o), ints[2], ints[3], ints[4],
                                floats[1], get_alibi(frame, o), get_sinks(frame, o))
                kernel((st3(argument(frame, 0), o), st3(argument(frame, 1), o),
                        st3(argument(frame, 2), o), cu_q, cu_k, ints[0] != 0, floats[0],
                        st3(result(frame, 0), o), ct2(result(frame, 1), o),
                        get_drop(frame, ints, floats, o, None), r,
                        ints[1] != 0))
        except Exception:  # (out of memory): the call fails with an XLA error
            return error(frame, failed)
        return 0

    return handler


def _make_varlen_backward(dtype, alibi=False, sinks=False, dropout=False, mods=None):
    """The varlen backward's cfunc: operands q, k, v, cu_seqlens_q, cu_seqlens_k, dout, out,
    lse, ints, floats, [ALiBi slopes], [sinks], [dropout's seed], [mod_args]; results dq, dk,
    dv in the
    compute dtype (sinks ride along in the recipe, as the NumPy API's: the kernel reads none
    of them; dropout is a run-time tuple, "off" without it: one kernel for both)."""
    from ..cpu.launch_varlen import backward_signature
    from ..cpu.varlen import varlen_backward
    from ..dropout import NO_DROPOUT
    from ._handlers import _recipe_type

    ct, st3, ct3, ct2, cu_seqlens, fail = _varlen_common(dtype)
    kernel = _native_call(varlen_backward, backward_signature(
        np.dtype(dtype), _recipe_type(ct, alibi, sinks, mods, block_mask=False)))
    get_alibi, get_sinks = _per_head(ct, alibi, sinks, 10)
    get_drop = _varlen_dropout(dropout, 10 + alibi + sinks)
    make_recipe = _recipe_maker(mods, 10 + alibi + sinks + dropout)
    no_drop = NO_DROPOUT
    failed = c_string("sdpa_numba.jax: the CPU varlen backward failed (out of memory?)")

    def handler(frame):
        if answer_metadata(frame):
            return 0
        ints, floats = _numbers(frame, 8, VARLEN_INTS, 9, VARLEN_FLOATS)
        qd, kd = dims(argument(frame, 0)), dims(argument(frame, 1))
        nb = qd.shape[0] - 3
        n_outer = _size(qd, 0, nb)
        total_q, total_k = qd[nb], kd[nb]
        for o in range(n_outer):
            _, _, bad = cu_seqlens(frame, o, ints, total_q, total_k)
            if bad >= 0:
                return fail(frame, bad)
        try:
            for o in range(n_outer):
                cu_q, cu_k, _ = cu_seqlens(frame, o, ints, total_q, total_k)
                r = make_recipe(frame, _lead_index(qd, nb, o), ints[2], ints[3], ints[4],
                                floats[1], get_alibi(frame, o), get_sinks(frame, o))
                kernel((st3(argument(frame, 0), o), st3(argument(frame, 1), o),
                        st3(argument(frame, 2), o), cu_q, cu_k, ints[0] != 0, floats[0],
                        st3(argument(frame, 5), o), st3(argument(frame, 6), o),
                        ct2(argument(frame, 7), o), ct3(result(frame, 0), o),
                        ct3(result(frame, 1), o), ct3(result(frame, 2), o),
                        get_drop(frame, ints, floats, o, no_drop), r,
                        ints[1] != 0))
        except Exception:
            return error(frame, failed)
        return 0

    return handler


def varlen_forward_target(dtype, alibi=False, sinks=False, dropout=False, mods=None):
    """The FFI target of the varlen forward for a storage dtype, ALiBi, sinks and dropout
    on/off and the user's functions (``mods``, as :func:`._handlers.forward_target`'s:
    without ``score_mod_grad``)."""
    return _target("varlen_forward", (np.dtype(dtype), bool(alibi), bool(sinks),
                                      bool(dropout), mods), _make_varlen_forward)


def varlen_backward_target(dtype, alibi=False, sinks=False, dropout=False, mods=None):
    """The FFI target of the varlen backward for a storage dtype, ALiBi, sinks and dropout
    on/off and the user's functions (``mods`` with its ``score_mod_grad``)."""
    return _target("varlen_backward", (np.dtype(dtype), bool(alibi), bool(sinks),
                                       bool(dropout), mods), _make_varlen_backward)


# ---------------------------------------------------------------- KV cache

#: ints of a KV-cache call: is_causal, left, right, chunk, paged, and a quantized cache's
#: format (its index in QUANT_NAMES; 0 for float caches)
KVCACHE_INTS = 6

#: The quantized caches' formats (:mod:`sdpa_numba.problem.quant`), by their code in ints,
#: and the kernels' format code of each.
QUANT_NAMES = ("int8", "q8_0", "e4m3fn", "e5m2")
_QUANT_FMT = np.array([0, 0, 1, 2], np.int64)


def _decode_signature(dtype, parallel, recipe_t, scale_dtype=None):
    """The decode kernel and the signature :func:`sdpa_numba.cpu.launch_decode.entry`
    compiles it with for recipe type ``recipe_t`` (float caches, or with ``scale_dtype``
    quantized ones, every format one signature): one compiled kernel for both APIs."""
    from numba import types

    from ..cpu.decode import decode, decode_serial
    from ..cpu.launch import arr, kernel_types

    st, ct, _ = kernel_types(np.dtype(dtype), "none")
    cache_t = st if scale_dtype is None else types.int8
    if scale_dtype is None:
        quant_t = types.none
    else:
        sc_t = arr(types.uint16 if np.dtype(scale_dtype) == np.float16 else types.float32, 4,
                   True)
        d_t = arr(types.float32, 2, True)
        quant_t = types.Tuple((sc_t, sc_t, d_t, d_t, types.int64))
    sig = (arr(st, 4, True), arr(cache_t, 4, True), arr(cache_t, 4, True),
           arr(types.int32, 2, True), arr(types.int64, 1, True), types.boolean, types.float64,
           arr(st, 4, False), arr(ct, 3, False), recipe_t, arr(types.int64, 1, True), quant_t)
    return (decode if parallel else decode_serial), sig


@njit
def _new_row(x, b, t, row, table, seqlens, page_size):
    """New row ``t`` of sequence ``b`` of an append ``x`` (storage dtype) into ``row`` ``(1, 1,
    H, D)`` in the compute dtype (the NumPy API quantizes from float32, or float64 for
    float64: exact conversions); its cache slot ``(page, slot)``."""
    for h in range(x.shape[2]):
        for e in range(x.shape[3]):
            row[0, 0, h, e] = load(x[b, t, h, e])
    pos = seqlens[b] + t
    return table[b, pos // page_size], pos % page_size


def _quant_parts(quant, ct, st, appending, i_scale, bad_scale, bad_rows):
    """What a KV-cache handler does differently with a quantized cache (``quant``: None, or
    ``(scale dtype, fp8)``), as jitted functions: ``(cache4, write, check, get_quant,
    per_key)``:

    * ``cache4(buffer)``: a cache result's 4-D view (the storage dtype, or int8);
    * ``write(frame, k, v, k_cache, v_cache, table, seqlens, page_size, quant)``: the append,
      quantizing as :func:`sdpa_numba.cpu.launch_decode.append_quantized` (row by row: the
      same rule element by element, so the same bits) into the caches and, for int8 / q8_0,
      their scales;
    * ``check(frame, k, v, code)``: -1, or the offset of the message of the first scale
      (``bad_scale``: k's, v's) or new row (``bad_rows[code]``: k's, v's) that is not
      finite (:func:`sdpa_numba.problem.quant.check_scales`' order);
    * ``get_quant(frame, n, s, b_len, h_len, code)``: the kernel's ``quant`` tuple
      (:func:`sdpa_numba.cpu.launch_decode._quant_args`: scales ``(N, S, H, n_blocks)``,
      ones for fp8; descales ``(B, H)``, ones for int8), or None;
    * ``per_key(e, ev)``: bytes read per key and head (the kernel choice's).

    The scales are operands ``i_scale``, ``i_scale + 1``; appending into an int8 / q8_0
    cache, results 4 and 5 (aliased to them: they hold the operands' values)."""
    from ..cpu.quant import quantize_blocks, quantize_fp8
    from ..cpu.storage import store

    view4 = _tail_view(st, 4)
    sz = np.dtype(st).itemsize

    @njit
    def check_rows(k, v, code):
        if k is None:
            return -1
        for n, x in enumerate((k, v)):
            for b in range(x.shape[0]):
                for t in range(x.shape[1]):
                    for h in range(x.shape[2]):
                        for e in range(x.shape[3]):
                            if not np.isfinite(load(x[b, t, h, e])):
                                return bad_rows[2 * code + n]
        return -1

    if quant is None:
        @njit
        def cache4(buffer):
            return view4(buffer, 0)

        @njit
        def write(frame, k, v, k_cache, v_cache, table, seqlens, page_size, qz):
            """The append: row ``t`` of sequence ``b`` into slot ``seqlens[b] + t``."""
            if k is None:
                return
            for b in range(seqlens.shape[0]):
                for t in range(k.shape[1]):
                    pos = seqlens[b] + t
                    page, slot = table[b, pos // page_size], pos % page_size
                    k_cache[page, slot] = k[b, t]
                    v_cache[page, slot] = v[b, t]

        @njit
        def check(frame, k, v, code):
            return -1

        @njit
        def get_quant(frame, n, s, b_len, h_len, code):
            return None

        @njit
        def per_key(frame, e, ev):
            return (e + ev) * sz

        return cache4, write, check, get_quant, per_key

    scale_dtype, fp8 = quant
    half = np.dtype(scale_dtype) == np.float16
    sc_t = np.uint16 if half else np.float32
    ssz = np.dtype(sc_t).itemsize
    int8_4 = _tail_view(np.int8, 4)
    # an append into int8 / q8_0 caches writes the scales: the aliased results
    in_results = appending and not fp8

    @njit
    def cache4(buffer):
        return int8_4(buffer, 0)

    @njit
    def scale_buffer(frame, n):
        return result(frame, 4 + n) if in_results else argument(frame, i_scale + n)

    @njit
    def finite(buffer):
        d = dims(buffer)
        a = carray(as_pointer(data(buffer)), (_size(d, 0, d.shape[0]),), sc_t)
        for i in range(a.shape[0]):
            if not np.isfinite(load(a[i])):
                return False
        return True

    @njit
    def check(frame, k, v, code):
        for n in range(2):
            if not finite(scale_buffer(frame, n)):
                return bad_scale[n]
        return check_rows(k, v, code)

    @njit
    def blocks(buffer):
        """An int8 cache's scales ``(N, S, H)`` or ``(N, S, H, E // 32)`` as 4-D."""
        d = dims(buffer)
        nb = d[3] if d.shape[0] == 4 else 1
        return carray(as_pointer(data(buffer)), (d[0], d[1], d[2], nb), sc_t)

    @njit
    def descale(buffer, b_len, h_len):
        """An fp8 cache's descale (a scalar, or ``(B, H)``) as ``(B, H)``."""
        a = carray(as_pointer(data(buffer)), (1,), np.float32)
        if dims(buffer).shape[0] == 0:
            return np.lib.stride_tricks.as_strided(a, (b_len, h_len), (0, 0))
        return np.lib.stride_tricks.as_strided(a, (b_len, h_len), (4 * h_len, 4))

    if fp8:
        @njit
        def get_quant(frame, n, s, b_len, h_len, code):
            ones = np.lib.stride_tricks.as_strided(np.ones(1, np.float32), (n, s, h_len, 1),
                                                   (0, 0, 0, 0))
            return (ones, ones, descale(scale_buffer(frame, 0), b_len, h_len),
                    descale(scale_buffer(frame, 1), b_len, h_len), _QUANT_FMT[code])

        @njit
        def per_key(frame, e, ev):
            return e + ev

        @njit
        def put_rows(x, cache, frame, n, table, seqlens, page_size, fmt):
            h_len, d_len = x.shape[2], x.shape[3]
            desc = descale(scale_buffer(frame, n), x.shape[0], h_len)
            row = np.empty((1, 1, h_len, d_len), ct)
            bits = np.empty((1, 1, h_len, d_len), np.int8)
            for b in range(seqlens.shape[0]):
                for t in range(x.shape[1]):
                    page, slot = _new_row(x, b, t, row, table, seqlens, page_size)
                    quantize_fp8(row, bits, desc[b:b + 1], fmt)
                    cache[page, slot] = bits[0, 0]
    else:
        @njit
        def get_quant(frame, n, s, b_len, h_len, code):
            ones = np.lib.stride_tricks.as_strided(np.ones(1, np.float32), (b_len, h_len),
                                                   (0, 0))
            return (blocks(scale_buffer(frame, 0)), blocks(scale_buffer(frame, 1)), ones,
                    ones, _QUANT_FMT[code])

        @njit
        def per_key(frame, e, ev):
            if dims(scale_buffer(frame, 0)).shape[0] == 3:  # int8: one scale per key, head
                return e + ev + 2 * ssz
            return e + ev + (e + ev) // 32 * ssz  # q8_0

        @njit
        def put_rows(x, cache, frame, n, table, seqlens, page_size, fmt):
            h_len, d_len = x.shape[2], x.shape[3]
            scales = blocks(scale_buffer(frame, n))
            nb = scales.shape[3]
            row = np.empty((1, 1, h_len, d_len), ct)
            values = np.empty((1, 1, h_len, d_len), np.int8)
            sc = np.empty((1, 1, h_len, nb), np.float32)
            for b in range(seqlens.shape[0]):
                for t in range(x.shape[1]):
                    page, slot = _new_row(x, b, t, row, table, seqlens, page_size)
                    quantize_blocks(row, values, sc, half)
                    cache[page, slot] = values[0, 0]
                    for h in range(h_len):
                        for c in range(nb):
                            scales[page, slot, h, c] = store(sc[0, 0, h, c], scales)

    @njit
    def write(frame, k, v, k_cache, v_cache, table, seqlens, page_size, qz):
        if k is None:
            return
        put_rows(k, k_cache, frame, 0, table, seqlens, page_size, qz[4])
        put_rows(v, v_cache, frame, 1, table, seqlens, page_size, qz[4])

    return cache4, write, check, get_quant, per_key


def _make_kvcache(dtype, appending, alibi=False, sinks=False, mods=None, quant=None):
    """The KV-cache cfunc: operands q, k_cache, v_cache, cache_seqlens, block_table,
    cache_leftpad, [k, v], ints, floats, [ALiBi slopes (B or 1, Hq)], [sinks (Hq,)],
    [k_scale, v_scale], [mod_args]; results out, k_cache, v_cache (aliased to the operands:
    XLA hands the handler the caches' contents in them), lse, and appending into an int8 /
    q8_0 cache k_scale, v_scale (aliased likewise). ``quant``: None, or a quantized cache's
    ``(scale dtype, fp8)`` (:func:`_quant_parts`)."""
    from ..cpu.decode import _key_bounds
    from ..cpu.launch_decode import SERIAL_BYTES
    from ..problem.dtypes import compute_dtype

    st = _storage(dtype)
    ct = compute_dtype(dtype).type
    from ._handlers import _recipe_type

    recipe_t = _recipe_type(ct, alibi, sinks, mods, block_mask=False)
    scale_dtype = None if quant is None else quant[0]
    parallel = _native_call(*_decode_signature(dtype, True, recipe_t, scale_dtype))
    serial = _native_call(*_decode_signature(dtype, False, recipe_t, scale_dtype))
    i_ints = 8 if appending else 6
    i_floats = i_ints + 1
    get_alibi, get_sinks = _per_head(ct, alibi, sinks, i_floats + 1)
    i_scale = i_floats + 1 + alibi + sinks
    make_recipe = _recipe_maker(mods, i_scale + 2 * (quant is not None))
    no_lead = np.zeros(0, np.int64)  # no vmap: the operands have no leading dims
    texts, at = _messages(*[f"sdpa_numba.jax.attention_with_kvcache: {m}" for m in (
        "cache_seqlens must be >= 0 (nothing was written)",
        "cache_leftpad must be in [0, cache_seqlens + Lq_new] (nothing was written)",
        "cache_seqlens + Lq_new is beyond the cache's slots per sequence (S_max, or "
        "max_pages * page_size; nothing was written)",
        "block_table has an entry among the pages in use outside [0, num_pages) (nothing "
        "was written)",
        "the append would write into a page that block_table lists more than once among "
        "the pages in use (shared pages are read-only; nothing was written)",
        *[f"{n}_scale must be finite (it has NaN or inf; nothing was written)"
          for n in "kv"],
        *[f"{n} must be finite to be quantized into a {f} cache (it has NaN or inf; "
          f"nothing was written)" for f in QUANT_NAMES for n in "kv"])])
    negative, leftpad_bad, beyond, table_bad, shared = at[:5]
    cache4, write, check_quant, get_quant, per_key = _quant_parts(
        quant, ct, st, appending, i_scale, np.array(at[5:7], np.int64),
        np.array(at[7:], np.int64))
    failed = c_string("sdpa_numba.jax: the CPU KV-cache attention failed (out of memory?)")

    view4 = _tail_view(st, 4)

    @njit
    def st4(buffer):
        return view4(buffer, 0)

    @njit
    def check(kv_lens, seqlens, leftpad, table, capacity, page_size, n_pages, lq_new, paged):
        """-1, or the offset in ``texts`` of the message of the first check that fails
        (kvcache_problem's order)."""
        b_len = seqlens.shape[0]
        for b in range(b_len):
            if seqlens[b] < 0:
                return negative
        for b in range(b_len):
            if leftpad[b] < 0 or leftpad[b] > kv_lens[b]:
                return leftpad_bad
        for b in range(b_len):
            if kv_lens[b] > capacity:
                return beyond
        if paged:
            counts = np.zeros(n_pages, np.int64)
            for b in range(b_len):
                used = (kv_lens[b] + page_size - 1) // page_size
                for j in range(used):
                    e = table[b, j]
                    if e < 0 or e >= n_pages:
                        return table_bad
                    counts[e] += 1
            if lq_new:
                for b in range(b_len):
                    used = (kv_lens[b] + page_size - 1) // page_size
                    for j in range(seqlens[b] // page_size, used):
                        if counts[table[b, j]] > 1:
                            return shared
        return -1

    @njit
    def new_rows(frame):
        """The new keys and values ``(k, v)`` of an append."""
        return st4(argument(frame, 6)), st4(argument(frame, 7))

    @njit
    def no_rows(frame):
        return None, None

    rows = new_rows if appending else no_rows

    @njit
    def n_new(k):
        return 0 if k is None else k.shape[1]

    def handler(frame):
        if answer_metadata(frame):
            return 0
        ints, floats = _numbers(frame, i_ints, KVCACHE_INTS, i_floats, 2)
        q = st4(argument(frame, 0))
        k_cache, v_cache = cache4(result(frame, 1)), cache4(result(frame, 2))
        out = st4(result(frame, 0))
        ld = dims(result(frame, 3))
        lse = carray(as_pointer(data(result(frame, 3))), (ld[0], ld[1], ld[2]), ct)
        b_len, lq = q.shape[0], q.shape[1]
        n_pages, page_size = k_cache.shape[0], k_cache.shape[1]
        tb = dims(argument(frame, 4))
        table = carray(as_pointer(data(argument(frame, 4))), (tb[0], tb[1]), np.int32)
        seqlens = _ints_at(argument(frame, 3), 0, b_len)
        leftpad = _ints_at(argument(frame, 5), 0, b_len)
        k, v = rows(frame)
        lq_new = n_new(k)
        kv_lens = seqlens + lq_new
        bad = check(kv_lens, seqlens, leftpad, table, tb[1] * page_size, page_size, n_pages,
                    lq_new, ints[4] != 0)
        if bad < 0:
            bad = check_quant(frame, k, v, ints[5])
        if bad >= 0:  # before anything is written
            return error(frame, texts[bad:])
        qz = get_quant(frame, n_pages, page_size, b_len, k_cache.shape[2], ints[5])
        write(frame, k, v, k_cache, v_cache, table, seqlens, page_size, qz)
        if out.size == 0 and lse.size == 0:
            return 0
        r = make_recipe(frame, no_lead, ints[1], ints[2], ints[3], floats[1],
                        get_alibi(frame, 0), get_sinks(frame, 0))
        # The NumPy API's choice of kernel (sdpa_numba.cpu.launch_decode.prepare): by the
        # bytes of keys and values read, so that both give the same bits.
        lo = np.empty(b_len, np.int64)
        hi = np.empty(b_len, np.int64)
        _key_bounds(kernel_recipe(r, ints[0] != 0), kv_lens, leftpad, lq, lo, hi)
        n_read = 0
        for b in range(b_len):
            n_read += hi[b] - lo[b]
        read = n_read * k_cache.shape[2] * per_key(frame, k_cache.shape[3], v_cache.shape[3])
        args = (q, k_cache, v_cache, table, kv_lens, ints[0] != 0, floats[0], out, lse, r,
                lo, qz)
        try:
            if read >= SERIAL_BYTES:
                parallel(args)
            else:
                serial(args)
        except Exception:
            return error(frame, failed)
        return 0

    return handler


def kvcache_target(dtype, appending, alibi=False, sinks=False, mods=None, quant=None):
    """The FFI target of the KV-cache call for a storage dtype, with or without an append,
    ALiBi and sinks on/off, the user's functions (``mods``, as
    :func:`._handlers.forward_target`'s) and a quantized cache (``quant``: None or ``(scale
    dtype, fp8)``; the format within them is a run-time value)."""
    return _target("kvcache", (np.dtype(dtype), bool(appending), bool(alibi), bool(sinks),
                               mods, quant), _make_kvcache)
