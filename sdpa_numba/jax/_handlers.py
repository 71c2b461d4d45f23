"""The XLA FFI handlers: Numba ``@cfunc`` functions that read XLA's call frame
(:mod:`._frame`) and call the CPU kernels (:func:`sdpa_numba.cpu.forward.forward`,
:func:`sdpa_numba.cpu.backward.backward`) with no Python on the call path.

A handler is made per specialization (storage dtype, mask kind, ALiBi, sinks; and for the
backward whether the mask gradient is wanted), on first use, registered with XLA under its
own target name and kept for the process (:func:`forward_target`, :func:`backward_target`).
Shapes are not part of it: the handler reads every size from the frame's buffer dims.

Operands (XLA buffers, row-major) all have rank ``R = nb + 3`` (``nb >= 1`` batch dims, then
heads, rows, columns; the attention state ``lse`` rank ``R - 1``; ALiBi slopes and sinks
``nb + 1``); a dim of size 1 where the output's is larger is broadcast (stride 0), as are the
query's and the mask's heads, rows and columns. The last batch dim is the kernels' batch dim;
the handler launches the kernel once per index of the batch dims before it (one launch
without ``vmap``; ``vmap`` adds leading dims). Two small operands carry the numbers:
``ints = (offset, left, right, is_causal, n_batch, threshold)`` (int64) and ``floats =
(scale, softcap, inv_keep)`` (float64), in the kernels' encoding
(:mod:`sdpa_numba.score.recipe`, :func:`sdpa_numba.dropout.params`). ``n_batch`` is the flat
size of the caller's batch (without ``vmap``'s dims): the batch index that ``score_mod``,
``mask_mod`` and dropout see is the flat index within it, so that every ``vmap`` slice is
computed as the unmapped call would compute it.

After the numbers come, when the specialization has them, the dropout seed (two uint32 words,
low first) and the ``mod_args`` (arrays, or scalars carried as bytes in uint32 words): each
may carry ``vmap``'s leading dims, which the handler indexes as the batch's
(:func:`_lead_address`).
"""

import threading

import numpy as np
from numba import carray, cfunc, njit, typeof, types
from numba.core import cgutils
from numba.core.callconv import excinfo_t
from numba.extending import intrinsic

from .._runtime import kernel_launch, package_stamp, stamp_caches
from ..score.recipe import recipe
from ..targets import HOST
from ._frame import (CACHE, answer_metadata, argument, as_pointer, c_string, data, dims, error,
                     ranked, result)

#: Entries of the ``ints`` and ``floats`` operands (see the module's docstring).
N_INTS, N_FLOATS = 6, 3

_lock = threading.Lock()
_targets = {}
_viewers = {}


def _native_call(dispatcher, sig):
    """A jitted function calling ``dispatcher``'s compiled overload for ``sig`` by its address,
    with a tuple of its arguments (each converted to ``sig``'s type: a mutable array to its
    read-only type, None or an array to an Optional): the handlers pass the kernels exactly
    the types the NumPy API's launchers compile (:func:`sdpa_numba.cpu.launch.signature`), so
    that both run one compiled kernel (and ``sdpa_numba.warmup()``'s cache serves both).

    Called by address, not linked in: linking would have LLVM optimize the whole kernel again
    inside each handler (tens of seconds per handler). An exception the kernel raises is
    propagated to the handler as from any jitted call."""
    from llvmlite import ir

    from .._runtime import compile_entry

    compile_entry(dispatcher, sig)
    cres = dispatcher.overloads[tuple(sig)]
    address = cres.library.get_pointer_to_function(cres.fndesc.llvm_func_name)
    argtys = list(cres.signature.args)
    resty = cres.signature.return_type

    @intrinsic
    def call(typingctx, args):
        def codegen(context, builder, signature, llargs):
            conv = context.call_conv
            given = cgutils.unpack_tuple(builder, llargs[0])
            values = [context.cast(builder, v, t, to)
                      for v, t, to in zip(given, signature.args[0].types, argtys)]
            fnty = conv.get_function_type(resty, argtys)
            fn = builder.inttoptr(ir.Constant(ir.IntType(64), address), fnty.as_pointer())
            ret = cgutils.alloca_once(builder, conv.get_return_type(resty).pointee)
            builder.store(cgutils.get_null_value(ret.type.pointee), ret)
            excinfo = cgutils.alloca_once(builder, ir.PointerType(excinfo_t), name="excinfo")
            packed = list(conv._get_arg_packer(argtys).as_arguments(builder, values))
            code = builder.call(fn, [ret, excinfo] + packed)
            status = conv._get_return_status(builder, code, builder.load(excinfo))
            with cgutils.if_unlikely(builder, status.is_error):
                conv.return_status_propagate(builder, status)
            return context.get_dummy_value()

        if not isinstance(args, types.BaseTuple) or len(args) != len(argtys):
            return None
        return types.none(args), codegen

    return call


def _storage(dtype):
    """The NumPy type the kernels read a storage dtype as (float16 as uint16, bfloat16 as
    int16: :mod:`sdpa_numba.cpu.storage`)."""
    dtype = np.dtype(dtype)
    if dtype == np.float16:
        return np.uint16
    if dtype.name == "bfloat16":
        return np.int16
    return dtype.type


def _viewer(np_type):
    """``(view, view3, view2)``: jitted functions giving, for a buffer of ``np_type`` broadcast
    to dims ``full`` (rank ``R``), the 4-, 3- or 2-D strided view over its last ``3``, ``2``
    or ``1`` dims plus the last batch dim, at the outer batch indices ``idx``."""
    if np_type in _viewers:
        return _viewers[np_type]
    size = np.dtype(np_type).itemsize

    @njit
    def base(buffer, full, idx):
        d = dims(buffer)
        rank = d.shape[0]
        st = np.empty(rank, np.int64)
        s = 1
        for i in range(rank - 1, -1, -1):
            st[i] = 0 if d[i] == 1 and full[i] != 1 else s * size
            s *= d[i]
        off = 0
        for i in range(idx.shape[0]):
            off += idx[i] * st[i]
        return carray(as_pointer(data(buffer) + off), (1,), np_type), st

    @njit
    def view4(buffer, full, idx):
        a, st = base(buffer, full, idx)
        n = st.shape[0]
        return np.lib.stride_tricks.as_strided(
            a, (full[n - 4], full[n - 3], full[n - 2], full[n - 1]),
            (st[n - 4], st[n - 3], st[n - 2], st[n - 1]))

    @njit
    def view3(buffer, full, idx):
        a, st = base(buffer, full, idx)
        n = st.shape[0]
        return np.lib.stride_tricks.as_strided(a, (full[n - 3], full[n - 2], full[n - 1]),
                                               (st[n - 3], st[n - 2], st[n - 1]))

    @njit
    def view2(buffer, full, idx):
        a, st = base(buffer, full, idx)
        n = st.shape[0]
        return np.lib.stride_tricks.as_strided(a, (full[n - 2], full[n - 1]),
                                               (st[n - 2], st[n - 1]))

    _viewers[np_type] = (view4, view3, view2)
    return _viewers[np_type]


@njit(cache=CACHE)
def _full(batch, a, b, c):
    """Dims ``(*batch, a, b, c)``; ``c < 0`` drops the last (``b < 0`` the last two)."""
    nb = batch.shape[0]
    n = nb + (3 if c >= 0 else (2 if b >= 0 else 1))
    f = np.empty(n, np.int64)
    f[:nb] = batch
    f[nb] = a
    if b >= 0:
        f[nb + 1] = b
    if c >= 0:
        f[nb + 2] = c
    return f


@njit(cache=CACHE)
def _outer(batch, o):
    """The indices of outer launch ``o`` over all batch dims but the last."""
    n = batch.shape[0] - 1
    idx = np.empty(n, np.int64)
    for i in range(n - 1, -1, -1):
        idx[i] = o % batch[i]
        o //= batch[i]
    return idx


@njit(cache=CACHE)
def _geometry(frame):
    """The call's sizes: the batch dims and full dims of every operand, from result 0
    (``out`` or ``dq``, ``(*batch, Hq, L, .)``), ``k`` (``(.., H, S, E)``) and ``v`` (``Ev``).
    Returns ``(batch, n_outer, size, fulls)``: ``n_outer`` launches (the batch dims but the
    last), ``size`` = batch x Hq x L (0: nothing to compute), ``fulls`` the full dims of q,
    k, v, the mask, out, lse and the per-head operands (ALiBi slopes, sinks)."""
    rd, kd, vd = dims(result(frame, 0)), dims(argument(frame, 1)), dims(argument(frame, 2))
    nb = rd.shape[0] - 3
    batch = rd[:nb].copy()
    hq, L = rd[nb], rd[nb + 1]
    h, s, e, ev = kd[nb], kd[nb + 1], kd[nb + 2], vd[nb + 2]
    n_outer = 1
    size = hq * L
    for i in range(nb):
        size *= batch[i]
        if i < nb - 1:
            n_outer *= batch[i]
    fulls = (_full(batch, hq, L, e), _full(batch, h, s, e), _full(batch, h, s, ev),
             _full(batch, hq, L, s), _full(batch, hq, L, ev), _full(batch, hq, L, -1),
             _full(batch, hq, -1, -1))
    return batch, n_outer, size, fulls


@njit(cache=CACHE)
def _empty(full):
    """Whether dims ``full`` hold no element."""
    n = 1
    for d in full:
        n *= d
    return n == 0


@njit(cache=CACHE)
def _numbers(frame, i_ints, i_floats):
    """The ``ints`` and ``floats`` operands (see the module's docstring)."""
    return (carray(as_pointer(data(argument(frame, i_ints))), (N_INTS,), np.int64),
            carray(as_pointer(data(argument(frame, i_floats))), (N_FLOATS,), np.float64))


@njit(cache=CACHE)
def _call(frame, i_ints, i_floats):
    """What every handler reads first: ``q``, ``k``, ``v``, the numbers and the geometry
    (:func:`_numbers`, :func:`_geometry`)."""
    ints, floats = _numbers(frame, i_ints, i_floats)
    batch, n_outer, size, fulls = _geometry(frame)
    return (argument(frame, 0), argument(frame, 1), argument(frame, 2), ints, floats, batch,
            n_outer, size, fulls)


@njit(cache=CACHE)
def _absent(frame, n, full, idx):
    return None


def _small_views(ct):
    """Jitted functions giving ALiBi slopes ``(B, Hq)`` and sinks ``(Hq,)`` of one launch as
    C-contiguous arrays (their operands come broadcast to the full batch: the last batch dim
    is never a stride-0 one)."""
    view2 = _viewer(ct)[2]

    @njit
    def alibi(frame, n, full, idx):
        a = view2(argument(frame, n), full, idx)
        return carray(as_pointer(a.ctypes.data), a.shape, ct)

    @njit
    def sinks(frame, n, full, idx):
        a = view2(argument(frame, n), full, idx)
        return carray(as_pointer(a.ctypes.data), (a.shape[1],), ct)

    return alibi, sinks


def _optional(present, make):
    """``make`` where the operand is present, else a function giving None (both typed at
    compile time: a missing operand is a None in the kernel's types, as the NumPy launch's)."""
    return make if present else _absent


def _indices(mask_kind, alibi, sinks, tail, dropout=False, n_mod_args=0):
    """Operand numbers: (mask, alibi, sinks, then the ``tail`` names, then the dropout seed
    and the ``mod_args``) after q, k, v; ``mod_args`` is the first mod_arg's."""
    n = 3
    out = {}
    for name, present in (("mask", mask_kind != "none"), ("alibi", alibi), ("sinks", sinks)):
        out[name] = n if present else -1
        n += present
    for name in tail:
        out[name] = n
        n += 1
    out["seed"] = n if dropout else -1
    n += dropout
    out["mod_args"] = n
    return out


#: No chunked local attention: sdpa_numba.jax does not take ``chunk``.
_NO_CHUNK = np.int64(0)


@njit(cache=CACHE)
def _lead_address(buffer, core_rank, itemsize, idx):
    """The address of the entry of ``buffer`` (elements of ``itemsize`` bytes, rank
    ``core_rank`` plus the leading dims ``vmap`` added) at outer batch indices ``idx``: the
    leading dims are the batch's first (``vmap``'s), a dim of size 1 broadcast."""
    d = dims(buffer)
    rank = d.shape[0]
    n_lead = rank - core_rank
    off = 0
    s = itemsize
    for i in range(rank - 1, -1, -1):
        if i < n_lead and d[i] != 1:
            off += idx[i] * s
        s *= d[i]
    return data(buffer) + off


@njit(cache=CACHE)
def _launch_offset(batch, ints, o):
    """The flat batch index, within the caller's batch (``ints[4]`` entries: ``vmap``'s dims
    left out), of outer launch ``o``'s first entry."""
    return (o * batch[batch.shape[0] - 1]) % max(ints[4], 1)


_GET_SOURCE = """
def get(frame, idx):
    b = argument(frame, n)
    d = dims(b)
    r = d.shape[0]
    return carray(as_pointer(_lead_address(b, {nd}, size, idx)), ({last}), dt)
"""


def _mod_arg_getter(n, spec):
    """A jitted ``get(frame, idx)``: mod_arg operand ``n`` of ``spec`` ``(dtype, ndim,
    carried)`` at outer batch indices ``idx``: a C-contiguous array of ``ndim`` dims (the
    type the NumPy API's ``typeof`` gives a C-contiguous array: one compiled kernel for both),
    or for ``ndim`` 0 a scalar (``carried`` "bytes": in uint32 words; "array": a 0-d array)."""
    dtype, ndim, carried = spec
    dt = np.dtype(dtype).type
    size = np.dtype(dtype).itemsize
    if ndim == 0:
        core, item = (1, 4) if carried == "bytes" else (0, size)

        @njit
        def scalar(frame, idx):
            a = _lead_address(argument(frame, n), core, item, idx)
            return carray(as_pointer(a), (1,), dt)[0]
        return scalar
    return ranked(_GET_SOURCE, ndim, argument=argument, dims=dims, carray=carray,
                  as_pointer=as_pointer, _lead_address=_lead_address, n=n, size=size, dt=dt)


def _mod_args_getter(first, specs):
    """A jitted ``get(frame, idx)`` giving the tuple of the ``mod_args`` (operands ``first``
    on, :func:`_mod_arg_getter` each), built one entry at a time (a jitted tuple of mixed
    types cannot come from a loop)."""
    if not specs:
        @njit
        def none(frame, idx):
            return ()
        return none
    head = _mod_arg_getter(first, specs[0])
    rest = _mod_args_getter(first + 1, specs[1:])

    @njit
    def get(frame, idx):
        return (head(frame, idx),) + rest(frame, idx)
    return get


def _sample_mod_arg(spec):
    """A host value of ``spec``'s Numba type (for the recipe's type)."""
    dtype, ndim, _ = spec
    if ndim == 0:
        return np.dtype(dtype).type(0)
    return np.zeros((1,) * ndim, dtype)


def _recipe_type(ct, alibi, sinks, mods=None, block_mask=True):
    """The Numba type of the NumPy API's recipe with (or without) ALiBi slopes, sinks and the
    user's functions (C-contiguous arrays of the compute dtype,
    :func:`sdpa_numba.problem.variant_table.check_alibi`; with ``block_mask``, a ``mask_mod``
    comes with a block mask, as the dense API's,
    :func:`sdpa_numba.problem.block_mask.with_block_mask`; the serving functions' come
    without)."""
    extra = {}
    if mods is not None:
        score_mod, mask_mod, score_mod_grad, specs = mods
        extra = dict(score_mod=score_mod, mask_mod=mask_mod, score_mod_grad=score_mod_grad,
                     mod_args=tuple(_sample_mod_arg(x) for x in specs),
                     block_mask=None if mask_mod is None or not block_mask
                     else np.zeros((1, 1, 1, 1), np.int8))
    return typeof(recipe(alibi=np.zeros((1, 1), ct) if alibi else None,
                         sinks=np.zeros(1, ct) if sinks else None, **extra))


def _operands(dtype, mask_kind, alibi, sinks, mods=None, dropout=False, tail=()):
    """What both directions read the same way: the compute type, the 4-D view of a storage
    operand, the kernels' leading arguments of one batch index (q, k, v, the optional
    mask, is_causal and scale) and its recipe (ALiBi slopes, sinks, the user's functions with
    their ``mod_args`` and an all-partial block mask, when it has them), and the operand
    numbers (:func:`_indices`)."""
    from ..problem.dtypes import compute_dtype
    from ..score.blocks import BLOCK_PARTIAL, K_BLOCK, Q_BLOCK

    st = _storage(dtype)
    ct = compute_dtype(dtype).type
    mask_view4 = _viewer(np.bool_ if mask_kind == "bool" else st)[0]
    alibi_view, sinks_view = _small_views(ct)
    score_mod, mask_mod, score_mod_grad, specs = mods if mods is not None else (
        None, None, None, ())
    at = _indices(mask_kind, alibi, sinks, tail, dropout, len(specs))
    i_mask, i_alibi, i_sinks = at["mask"], at["alibi"], at["sinks"]
    mod_args_at = _mod_args_getter(at["mod_args"], specs)
    partial = np.int8(BLOCK_PARTIAL)

    @njit
    def _mask(frame, n, full, idx):
        return mask_view4(argument(frame, n), full, idx)

    get_alibi = _optional(alibi, alibi_view)
    get_sinks = _optional(sinks, sinks_view)

    @njit
    def all_partial(fulls):
        # A mask_mod's block mask: every block partial (the mask_mod per element; the NumPy
        # API's for small calls). Built from its mod_args' values, the NumPy API's would need
        # them on the host at trace time.
        f = fulls[3]
        n = f.shape[0]
        return np.full((1, 1, (f[n - 2] + Q_BLOCK - 1) // Q_BLOCK,
                        (f[n - 1] + K_BLOCK - 1) // K_BLOCK), partial, np.int8)

    @njit
    def no_block_mask(fulls):
        return None

    block_mask = all_partial if mask_mod is not None else no_block_mask

    @njit
    def recipe_at(frame, ints, floats, fulls, idx, batch_offset):
        f_h = fulls[6]
        # By keyword: a part the recipe gains later is None here unless given.
        return recipe(offset=ints[0], left=ints[1], right=ints[2], chunk=_NO_CHUNK,
                      softcap=floats[1], batch_offset=batch_offset,
                      alibi=get_alibi(frame, i_alibi, f_h, idx),
                      sinks=get_sinks(frame, i_sinks, f_h, idx), score_mod=score_mod,
                      mask_mod=mask_mod, score_mod_grad=score_mod_grad,
                      mod_args=mod_args_at(frame, idx), block_mask=block_mask(fulls))

    view4 = _viewer(st)[0]
    get_mask = _optional(mask_kind != "none", _mask)

    @njit
    def leading(frame, q, k, v, ints, floats, fulls, idx):
        """The kernels' first arguments, alike in both directions: q, k, v, the mask,
        is_causal and scale."""
        return (view4(q, fulls[0], idx), view4(k, fulls[1], idx), view4(v, fulls[2], idx),
                get_mask(frame, i_mask, fulls[3], idx), ints[3] != 0, floats[0])

    i_seed = at["seed"]

    @njit
    def drop_on(frame, ints, floats, idx, batch_offset):
        seed = carray(as_pointer(_lead_address(argument(frame, i_seed), 1, 4, idx)), (1,),
                      np.uint64)[0]
        return (seed, np.uint64(ints[5]), floats[2], batch_offset)

    return ct, view4, leading, recipe_at, drop_on, at


def _make_forward(dtype, mask_kind, alibi, sinks, mods=None, dropout=False):
    """The forward's cfunc for one specialization (see the module's docstring)."""
    from ..cpu.forward import forward
    from ..cpu.launch import signature

    ct, view4, leading, recipe_at, drop_on, at = _operands(dtype, mask_kind, alibi, sinks, mods,
                                                           dropout, ("ints", "floats"))
    lse_view = _viewer(ct)[1]
    i_ints, i_floats = at["ints"], at["floats"]
    # the NumPy API's launcher compiles this very signature (cpu.launch._entry)
    kernel = _native_call(forward, signature(np.dtype(dtype), mask_kind, dropout,
                                             _recipe_type(ct, alibi, sinks, mods)))

    @njit
    def drop_off(frame, ints, floats, idx, batch_offset):
        return None

    get_drop = drop_on if dropout else drop_off
    failed = c_string("sdpa_numba.jax: the CPU attention forward failed (out of memory?)")

    def handler(frame):
        if answer_metadata(frame):
            return 0
        out, lse = result(frame, 0), result(frame, 1)
        q, k, v, ints, floats, batch, n_outer, size, fulls = _call(frame, i_ints, i_floats)
        f_q, f_k, f_v, f_m, f_o, f_l, f_h = fulls
        if size == 0:  # no rows: nothing to write
            return 0
        try:
            for o in range(n_outer):
                idx = _outer(batch, o)
                b0 = _launch_offset(batch, ints, o)
                head = leading(frame, q, k, v, ints, floats, fulls, idx)
                r = recipe_at(frame, ints, floats, fulls, idx, b0)
                kernel(head + (view4(out, f_o, idx), lse_view(lse, f_l, idx),
                               get_drop(frame, ints, floats, idx, b0), r))
        except Exception:  # (out of memory): the call fails with an XLA error
            return error(frame, failed)
        return 0

    return handler


def _make_backward(dtype, mask_kind, alibi, sinks, mask_grad, mods=None, dropout=False):
    """The backward's cfunc for one specialization: results dq, dk, dv (and the mask's
    gradient with ``mask_grad``) in the compute dtype, of the full broadcast shapes."""
    from ..dropout import NO_DROPOUT

    ct, view4, leading, recipe_at, drop_on, at = _operands(
        dtype, mask_kind, alibi, sinks, mods, dropout,
        ("dout", "out", "lse", "ints", "floats"))
    cview4, lse_view, _ = _viewer(ct)
    i_dout, i_out, i_lse, i_ints, i_floats = (at[n] for n in
                                              ("dout", "out", "lse", "ints", "floats"))
    kernel = _native_call(*HOST.native_kernel("backward", dtype, mask_kind,
                                              _recipe_type(ct, alibi, sinks, mods)))
    no_drop = NO_DROPOUT

    @njit
    def drop_off(frame, ints, floats, idx, batch_offset):
        return no_drop

    # the backward takes dropout at run time (inv_keep 1: off): one kernel for both
    get_drop = drop_on if dropout else drop_off

    @njit
    def _dmask(frame, n, full, idx):
        return cview4(result(frame, n), full, idx)

    get_dmask = _optional(mask_grad, _dmask)
    failed = c_string("sdpa_numba.jax: the CPU attention backward failed (out of memory?)")

    def handler(frame):
        if answer_metadata(frame):
            return 0
        dout, out, lse = argument(frame, i_dout), argument(frame, i_out), argument(frame, i_lse)
        dq, dk, dv = result(frame, 0), result(frame, 1), result(frame, 2)
        q, k, v, ints, floats, batch, n_outer, size, fulls = _call(frame, i_ints, i_floats)
        f_q, f_k, f_v, f_m, f_o, f_l, f_h = fulls
        if _empty(f_q) and _empty(f_k) and _empty(f_v):  # no gradient has an element
            return 0
        try:
            for o in range(n_outer):
                idx = _outer(batch, o)
                b0 = _launch_offset(batch, ints, o)
                # sinks ride along as in the NumPy API's recipe (the backward reads none of
                # them: lse includes them): one compiled kernel for both
                r = recipe_at(frame, ints, floats, fulls, idx, b0)
                kernel(leading(frame, q, k, v, ints, floats, fulls, idx) + (
                        view4(dout, f_o, idx), view4(out, f_o, idx), lse_view(lse, f_l, idx),
                        cview4(dq, f_q, idx), cview4(dk, f_k, idx), cview4(dv, f_v, idx),
                        get_drop(frame, ints, floats, idx, b0),
                        get_dmask(frame, 3, f_m, idx), r))
        except Exception:  # (out of memory): the call fails with an XLA error
            return error(frame, failed)
        return 0

    return handler


def _stamp_own_caches():
    """Give the cached helpers here and in :mod:`._frame` the package's stamp, as the kernels'
    (:func:`sdpa_numba._runtime.stamp_caches`): they inline each other's code, so a cache must
    go stale when any file of the package changes, not only its own."""
    from numba.core.registry import CPUDispatcher

    from . import _frame

    stamp = package_stamp()
    for module in (_frame, globals()):
        for obj in list((vars(module) if module is _frame else module).values()):
            if isinstance(obj, CPUDispatcher) and hasattr(getattr(obj, "_cache", None),
                                                          "_cache_file"):
                obj._cache._cache_file._source_stamp = stamp


def _target(kind, key, make):
    """The registered FFI target name of specialization ``key``, made on first use."""
    import jax

    with _lock:
        if (kind, key) not in _targets:
            with kernel_launch():  # refuses what would crash; starts the threading layer
                pass
            stamp_caches()
            _stamp_own_caches()
            fn = cfunc(types.intp(types.intp), nogil=True)(make(*key))
            name = f"sdpa_numba_{kind}_{len(_targets)}"
            jax.ffi.register_ffi_target(name, jax.ffi.pycapsule(fn.address), platform="cpu")
            _targets[kind, key] = (name, fn)  # the cfunc kept alive with its name
        return _targets[kind, key][0]


def forward_target(dtype, mask_kind, alibi, sinks, mods=None, dropout=False):
    """The FFI target of the forward for a storage dtype, mask kind ("none", "bool",
    "additive"), ALiBi and sinks on/off, the user's functions (``mods``: None or
    ``(score_mod, mask_mod, None, mod_arg specs)``, the functions by identity) and dropout
    on/off."""
    return _target("forward", (np.dtype(dtype), mask_kind, bool(alibi), bool(sinks), mods,
                               bool(dropout)), _make_forward)


def backward_target(dtype, mask_kind, alibi, sinks, mask_grad, mods=None, dropout=False):
    """The FFI target of the backward (see :func:`forward_target`; ``mask_grad``: an
    additive mask's gradient is a fourth result; ``mods`` with its ``score_mod_grad``)."""
    return _target("backward", (np.dtype(dtype), mask_kind, bool(alibi), bool(sinks),
                                bool(mask_grad), mods, bool(dropout)), _make_backward)
