"""Small LLVM intrinsics that Numba's CPU target does not offer.

* raw data pointers and pointer offsets, so that the hot loops index without the negative-index
  wraparound that turns vector loads into gathers;
* a fixed-size stack buffer (``alloca``) that LLVM promotes to registers;
* a function attribute asking for 512-bit vectors in the function being compiled (LLVM prefers
  256-bit code on many AVX-512 CPUs; setting it per function leaves the rest of the user's
  Numba code untouched, unlike a process-wide ``NUMBA_CPU_FEATURES``), and whether the CPU
  Numba compiles for has 512-bit vector registers at all;
* float16 <-> float32 conversion of uint16 bit patterns (Numba's CPU target has no float16);
* bfloat16 <-> float32 conversion of int16 bit patterns (nor bfloat16);
* a row multiply-add that LLVM may fuse but not reorder, for sums whose order must not change;
* lane-wise dot products of a few rows with a few keys, reduced together by a
  transpose-and-add tree;
* rint(x) and 2**rint(x) by the magic-number trick, for the vectorizable exp2;
* an atomic fetch-and-add, for the kernels' task queue (:mod:`.tasks`).
"""

import functools
import inspect

import numpy as np
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic


@intrinsic
def data_ptr(typingctx, arr):
    """Pointer to the first element of ``arr`` (no bounds, no wraparound)."""
    if not isinstance(arr, types.Array):
        return None
    sig = types.CPointer(arr.dtype)(arr)

    def codegen(context, builder, signature, args):
        ary = context.make_array(signature.args[0])(context, builder, args[0])
        return ary.data

    return sig, codegen


@intrinsic
def ptr_add(typingctx, ptr, n):
    """``ptr + n`` elements."""
    if not isinstance(ptr, types.CPointer) or not isinstance(n, types.Integer):
        return None
    sig = ptr(ptr, n)

    def codegen(context, builder, signature, args):
        return builder.gep(args[0], [args[1]])

    return sig, codegen


def stack_buffer(n):
    """Make an intrinsic ``f(like)`` returning a pointer to ``n`` stack elements of the element
    type of the pointer ``like``.

    The size is fixed when the intrinsic is made, so that LLVM sees a constant-size alloca
    it can promote to registers once the loops over it are unrolled.
    """

    @intrinsic
    def _stack_empty(typingctx, like):
        if not isinstance(like, types.CPointer):
            return None
        dt = like.dtype
        sig = like(like)

        def codegen(context, builder, signature, args):
            ty = context.get_data_type(dt)
            return cgutils.alloca_once(builder, ty, size=context.get_constant(types.intp, n))

        return sig, codegen

    return _stack_empty


@intrinsic
def prefer_512_bit(typingctx):
    """Ask LLVM for 512-bit vectors in the function this is compiled into."""
    sig = types.void()

    def codegen(context, builder, signature, args):
        # llvmlite's attribute set only accepts valueless attributes; this string attribute
        # is rendered verbatim in the function definition. A no-op on CPUs without AVX-512.
        set.add(builder.function.attributes, '"prefer-vector-width"="512"')
        return context.get_dummy_value()

    return sig, codegen


_PROBE_IR = """
define <16 x float> @probe(<16 x float> %a, <16 x float> %b) {
  %c = fadd <16 x float> %a, %b
  ret <16 x float> %c
}
"""


@functools.cache  # asked by the micro-kernel and by decode
def has_512_bit_vectors():
    """Whether the CPU that Numba compiles for has 512-bit vector registers (AVX-512).

    Asks LLVM with the CPU name and features Numba's code generator uses, so that
    ``NUMBA_CPU_NAME`` / ``NUMBA_CPU_FEATURES`` are honoured (a CPU name without features, or
    features that leave ``avx512f`` to the name's defaults, included): a 16-float addition
    compiled for that target uses zmm registers exactly when it has them. Milliseconds; once,
    at import.
    """
    return "zmm" in probe_assembly(_PROBE_IR)


def probe_assembly(llvm_ir, name=None, features=None):
    """The assembly LLVM emits for the module ``llvm_ir`` on a CPU: by default the one Numba's
    code generator compiles for (``NUMBA_CPU_NAME`` / ``NUMBA_CPU_FEATURES`` honoured), else
    CPU ``name`` with the LLVM feature string ``features`` (a feature it leaves out takes the
    name's default). What a probe's instructions become says what the CPU has."""
    import llvmlite.binding as ll
    from numba.core import codegen, config

    codegen.initialize_llvm()
    if name is None:
        name = config.CPU_NAME or ll.get_host_cpu_name()
    if features is None:
        features = (config.CPU_FEATURES if config.CPU_FEATURES is not None
                    else codegen.get_host_cpu_features())
    tm = ll.Target.from_triple(ll.get_process_triple()).create_target_machine(
        cpu=name, features=features, opt=2)
    mod = ll.parse_assembly(llvm_ir)
    mod.verify()
    return tm.emit_assembly(mod)


@intrinsic
def no_inline(typingctx):
    """Keep LLVM from inlining the function this is compiled into into its callers.

    Numba links a callee into its caller's module and LLVM inlines it there; this keeps it a
    call, so that the callee's values (its hoisted constants) take no registers in the caller.
    """
    sig = types.void()

    def codegen(context, builder, signature, args):
        builder.function.attributes.add("noinline")
        return context.get_dummy_value()

    return sig, codegen


def _conversion(src, dst):
    """Make ``emit(builder, x)``, the LLVM value of a ``dst`` computed from the value ``x`` of
    a Numba ``src``, into an intrinsic ``f(x)`` of ``emit``'s name and doc, typed for ``src``
    only."""
    def make(emit):
        def typer(typingctx, x):
            if x != src:
                return None

            def codegen(context, builder, signature, args):
                return emit(builder, args[0])

            return dst(x), codegen

        typer.__name__, typer.__qualname__, typer.__doc__ = (emit.__name__, emit.__qualname__,
                                                            emit.__doc__)
        return intrinsic(typer)

    return make


@_conversion(types.uint16, types.float32)
def half_bits_to_float32(builder, bits):
    """The float32 value of a float16 stored as its uint16 bit pattern."""
    return builder.fpext(builder.bitcast(bits, ir.HalfType()), ir.FloatType())


@_conversion(types.float32, types.uint16)
def float32_to_half_bits(builder, x):
    """The uint16 bit pattern of ``x`` rounded to float16 (round to nearest even)."""
    return builder.bitcast(builder.fptrunc(x, ir.HalfType()), ir.IntType(16))


@_conversion(types.int16, types.float32)
def bf16_bits_to_float32(builder, bits):
    """The float32 value of a bfloat16 stored as its int16 bit pattern: its top 16 bits."""
    i32 = ir.IntType(32)
    return builder.bitcast(builder.shl(builder.zext(bits, i32), ir.Constant(i32, 16)),
                           ir.FloatType())


@_conversion(types.float32, types.int16)
def float32_to_bf16_bits(builder, x):
    """The int16 bit pattern of ``x`` rounded to bfloat16, to nearest even.

    Adding ``0x7fff`` plus the lowest kept bit to the float32's bits and dropping the low 16
    rounds ties to even, and carries into the exponent where it should: past the largest
    finite value that gives inf, as round-to-nearest must; infinities are exact. A NaN could
    carry into its sign or turn into inf, so it keeps its top bits with the quiet bit set.
    """
    i32 = ir.IntType(32)
    b = builder.bitcast(x, i32)
    lsb = builder.and_(builder.lshr(b, ir.Constant(i32, 16)), ir.Constant(i32, 1))
    rounded = builder.lshr(builder.add(builder.add(b, ir.Constant(i32, 0x7FFF)), lsb),
                           ir.Constant(i32, 16))
    quiet = builder.or_(builder.lshr(b, ir.Constant(i32, 16)), ir.Constant(i32, 0x40))
    is_nan = builder.fcmp_unordered("uno", x, x)
    return builder.trunc(builder.select(is_nan, quiet, rounded), ir.IntType(16))


def row_mul_add(width, lanes=False):
    """Make an intrinsic ``f(acc, x, b)``: ``acc[0:width] += x * b[0:width]`` (pointers, a
    scalar) as one vector operation with only the ``contract`` flag, for ``width`` fixed here;
    ``lanes``: ``x`` is a pointer too, ``acc[0:width] += x[0:width] * b[0:width]``.

    The multiply-add may be fused into an FMA, but the additions are never reassociated,
    whatever fast-math flags the caller has: a running sum of these over a loop keeps its
    written order. (Written as scalar ``+=`` under ``reassoc``, a register tile of 4 x 16
    float32 compiled for AVX2 had its loop over k vectorized as reductions, interleaved
    partial sums, which changed the last bits; written as scalar in-order adds, the SLP
    vectorizer left it scalar.) ``b`` needs no alignment.
    """

    @intrinsic
    def _row_mul_add(typingctx, acc, x, b):
        if not (isinstance(acc, types.CPointer) and isinstance(acc.dtype, types.Float)
                and acc == b and x == (acc if lanes else acc.dtype)):
            return None
        sig = types.void(acc, x, b)

        def codegen(context, builder, signature, args):
            fty = context.get_data_type(signature.args[0].dtype)
            align = signature.args[0].dtype.bitwidth // 8
            vty = ir.VectorType(fty, width)
            i32 = ir.IntType(32)
            pa = builder.bitcast(args[0], vty.as_pointer())
            pb = builder.bitcast(args[2], vty.as_pointer())
            if lanes:
                xs = builder.load(builder.bitcast(args[1], vty.as_pointer()), align=align)
            else:
                one = builder.insert_element(ir.Constant(vty, ir.Undefined), args[1],
                                             ir.Constant(i32, 0))
                xs = builder.shuffle_vector(one, ir.Constant(vty, ir.Undefined),
                                            ir.Constant(ir.VectorType(i32, width),
                                                        [0] * width))
            prod = builder.fmul(xs, builder.load(pb, align=align), flags=("contract",))
            total = builder.fadd(builder.load(pa, align=align), prod, flags=("contract",))
            builder.store(total, pa, align=align)
            return context.get_dummy_value()

        return sig, codegen

    return _row_mul_add


@intrinsic
def split_pow2(typingctx, x):
    """``(x - n, 2**n)`` with ``n = rint(x)``, for ``x`` whose ``n`` is in the normal exponent
    range (other ``x`` give a meaningless ``2**n``: callers select).

    The magic-number rounding: adding ``M = 1.5 * 2**mant + bias`` leaves ``M + n`` with the
    units in the low mantissa bits: the integer difference of the bit patterns is ``n``, and
    those bits shifted into the exponent field are ``2**n``. An add, an integer subtract, a
    conversion, a subtract and a shift, against a round (2 uops), a clamp, a conversion, a
    shift, an integer add and a subtract. (``n = (x + M) - M`` in floats would save the
    conversion, but Numba puts its fast-math flags on these instructions too, and with them
    LLVM folds ``x - ((x + M) - M)`` to 0; ``llvm.arithmetic.fence`` stops that but also
    stops the loop vectorizer.)
    """
    if x == types.float32:
        width, mant, bias = 32, 23, 127
    elif x == types.float64:
        width, mant, bias = 64, 52, 1023
    else:
        return None
    sig = types.UniTuple(x, 2)(x)

    def codegen(context, builder, signature, args):
        fty = args[0].type
        ity = ir.IntType(width)
        magic = 1.5 * 2.0 ** mant + bias
        magic_bits = int(np.array(magic, np.float32 if width == 32 else np.float64)
                         .view(np.int32 if width == 32 else np.int64))
        t = builder.bitcast(builder.fadd(args[0], ir.Constant(fty, magic)), ity)
        n = builder.sitofp(builder.sub(t, ir.Constant(ity, magic_bits)), fty)
        bits = builder.shl(t, ir.Constant(ity, mant))
        return context.make_tuple(builder, signature.return_type,
                                  [builder.fsub(args[0], n), builder.bitcast(bits, fty)])

    return sig, codegen


@intrinsic
def keep_alive(typingctx, x):
    """Does nothing, but counts as a use of ``x`` (e.g. a tuple of arrays).

    Numba frees an array after its last use in the code, even while a pointer from
    :func:`data_ptr` into it is still in use; calling this after the pointer's last use keeps
    the array alive until then.
    """
    sig = types.void(x)

    def codegen(context, builder, signature, args):
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def fetch_add(typingctx, arr, n):
    """Atomically add ``n`` to ``arr[0]`` (a 1-element int64 array shared by threads);
    returns the value before the add."""
    if not (isinstance(arr, types.Array) and arr.dtype == types.int64
            and isinstance(n, types.Integer)):
        return None
    sig = types.int64(arr, n)

    def codegen(context, builder, signature, args):
        ary = context.make_array(signature.args[0])(context, builder, args[0])
        val = context.cast(builder, args[1], signature.args[1], types.int64)
        return builder.atomic_rmw("add", ary.data, val, "monotonic")

    return sig, codegen


@intrinsic
def stash(typingctx, x):
    """A pointer to a copy of ``x`` (any Numba value: a named tuple of arrays, functions,
    tuples) on the calling function's stack; valid while that function runs. The caller
    keeps ``x`` alive (:func:`keep_alive`) until the pointer's last use.

    Numba's parfor lowering passes each variable that a ``prange`` body uses as an argument
    of the generated gufunc, which takes arrays and scalars only (not a tuple nested in a
    tuple, nor a function): such a value crosses into the parallel region as this pointer and
    is read back there with :func:`unstash`.
    """
    sig = types.CPointer(x)(x)

    def codegen(context, builder, signature, args):
        dm = context.data_model_manager[signature.args[0]]
        ptr = cgutils.alloca_once(builder, dm.get_data_type())
        builder.store(dm.as_data(builder, args[0]), ptr)
        return ptr

    return sig, codegen


@intrinsic
def unstash(typingctx, ptr):
    """The value that :func:`stash` stored at ``ptr`` (a new reference)."""
    if not isinstance(ptr, types.CPointer):
        return None
    sig = ptr.dtype(ptr)

    def codegen(context, builder, signature, args):
        ty = signature.return_type
        val = context.data_model_manager[ty].from_data(builder, builder.load(args[0]))
        context.nrt.incref(builder, ty, val)  # Numba releases it after its last use
        return val

    return sig, codegen



def _sum_tree(builder, vs, width):
    """The lane sums of the ``width`` vectors ``vs`` as one vector (lane ``d``: the sum of
    ``vs[d]``), by a transpose-and-add tree: each level adds the halves of two vectors' lane
    blocks into one vector, ``width - 1`` vector adds in all, where reducing each vector on its
    own takes ``log2(width)`` shuffles and adds per sum. The order of the additions is fixed by
    ``width``."""
    def mask(idx):
        return ir.Constant(ir.VectorType(ir.IntType(32), width), idx)

    bs = width  # lanes per dot in each input vector
    while len(vs) > 1:
        half = bs // 2
        lo, hi = [], []
        for src in (0, width):  # lanes of a, then of b
            for blk in range(width // bs):
                for o in range(half):
                    lo.append(src + blk * bs + o)
                    hi.append(src + blk * bs + half + o)
        vs = [builder.fadd(builder.shuffle_vector(vs[p], vs[p + 1], mask(lo)),
                           builder.shuffle_vector(vs[p], vs[p + 1], mask(hi)))
              for p in range(0, len(vs), 2)]
        bs = half
    return vs[0]


def lane_dots(n_rows, n_keys, width):
    """Make an intrinsic ``f(q, q_stride, kbase, koff, kh, e_len, out)``: the ``n_rows x
    n_keys`` dot products of the rows ``q + r * q_stride`` with the keys ``kbase + koff[kk] +
    kh`` over ``e_len`` elements (a positive multiple of ``width``), into ``out[r * n_keys +
    kk]`` (``n_rows * n_keys == width``).

    Each product is summed lane-wise (lane ``l`` takes the elements ``e = l mod width``, one
    fused multiply-add per vector), the accumulators in registers, and the ``width`` products
    are reduced together by the transpose-and-add tree: where LLVM vectorizes one dot product
    over ``e``, it reduces each one horizontally, about as much work as its multiply-adds.
    Every row vector is loaded once for ``n_keys`` keys and every key vector once for
    ``n_rows`` rows. The order of the additions depends on ``e_len`` and ``width`` only.
    """
    assert n_rows * n_keys == width and width & (width - 1) == 0

    @intrinsic
    def _lane_dots(typingctx, q, q_stride, kbase, koff, kh, e_len, out):
        if not (isinstance(q, types.CPointer) and q == kbase == out
                and koff == types.CPointer(types.int64)
                and all(isinstance(t, types.Integer) for t in (q_stride, kh, e_len))):
            return None
        sig = types.void(q, q_stride, kbase, koff, kh, e_len, out)

        def codegen(context, builder, signature, args):
            qp, qs, kb, ko, khv, el, op = args
            i64 = ir.IntType(64)
            qs, khv, el = (context.cast(builder, args[i], signature.args[i], types.int64)
                           for i in (1, 4, 5))
            ty = context.get_data_type(q.dtype)
            vty = ir.VectorType(ty, width)
            rows = [builder.gep(qp, [builder.mul(qs, ir.Constant(i64, r))])
                    for r in range(n_rows)]
            keys = [builder.gep(kb, [builder.add(builder.load(
                builder.gep(ko, [ir.Constant(i64, k)])), khv)]) for k in range(n_keys)]
            entry = builder.block
            loop = builder.append_basic_block("lane_dots.loop")
            done = builder.append_basic_block("lane_dots.done")
            builder.branch(loop)
            builder.position_at_end(loop)
            e = builder.phi(i64)
            e.add_incoming(ir.Constant(i64, 0), entry)
            accs = []
            for _ in range(width):
                a = builder.phi(vty)
                a.add_incoming(ir.Constant(vty, None), entry)
                accs.append(a)

            def vload(p):
                return builder.load(builder.bitcast(builder.gep(p, [e]), vty.as_pointer()),
                                    align=4)

            kv = [vload(p) for p in keys]
            qv = [vload(p) for p in rows]
            fma = cgutils.get_or_insert_function(
                builder.module, ir.FunctionType(vty, [vty] * 3),
                f"llvm.fma.v{width}{'f32' if q.dtype == types.float32 else 'f64'}")
            new = [builder.call(fma, [qv[r], kv[k], accs[r * n_keys + k]])
                   for r in range(n_rows) for k in range(n_keys)]
            e_next = builder.add(e, ir.Constant(i64, width))
            e.add_incoming(e_next, builder.block)
            for a, x in zip(accs, new):
                a.add_incoming(x, builder.block)
            builder.cbranch(builder.icmp_signed("<", e_next, el), loop, done)
            builder.position_at_end(done)
            builder.store(_sum_tree(builder, new, width),
                          builder.bitcast(op, vty.as_pointer()), align=4)
            return context.get_dummy_value()

        return sig, codegen

    return _lane_dots


@intrinsic
def prefetch(typingctx, ptr):
    """Ask for the cache line at ``ptr`` to be brought into the L2 cache (a hint: never
    faults, even at an invalid address)."""
    if not isinstance(ptr, types.CPointer):
        return None
    sig = types.void(ptr)

    def codegen(context, builder, signature, args):
        i8p = ir.IntType(8).as_pointer()
        i32 = ir.IntType(32)
        fn = cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(ir.VoidType(), [i8p, i32, i32, i32]),
            "llvm.prefetch.p0i8")
        builder.call(fn, [builder.bitcast(args[0], i8p), ir.Constant(i32, 0),
                          ir.Constant(i32, 2), ir.Constant(i32, 1)])
        return context.get_dummy_value()

    return sig, codegen


def splat(builder, x, vty):
    """Scalar ``x`` broadcast to every lane of vector type ``vty``."""
    i32 = ir.IntType(32)
    first = builder.insert_element(ir.Constant(vty, None), x, ir.Constant(i32, 0))
    return builder.shuffle_vector(first, ir.Constant(vty, None),
                                  ir.Constant(ir.VectorType(i32, vty.count), [0] * vty.count))


def over_keys(builder, name, init, n, step):
    """The loop of an intrinsic that keeps rows of accumulator vectors in registers over the
    keys ``j = 0 .. n - 1`` (``n`` an int64 value; none when ``n <= 0``): ``accs =
    step(j, accs)`` per key, from ``init`` (rows of vectors). Returns the accumulators after
    the loop (phis: ``init`` where it did not run)."""
    i64 = ir.IntType(64)
    entry = builder.block
    loop = builder.append_basic_block(f"{name}.loop")
    done = builder.append_basic_block(f"{name}.done")
    builder.cbranch(builder.icmp_signed(">", n, ir.Constant(i64, 0)), loop, done)
    builder.position_at_end(loop)
    j = builder.phi(i64)
    j.add_incoming(ir.Constant(i64, 0), entry)
    accs = []
    for row in init:
        accs.append([])
        for x in row:
            a = builder.phi(x.type)
            a.add_incoming(x, entry)
            accs[-1].append(a)
    new = step(j, accs)
    end = builder.block
    j_next = builder.add(j, ir.Constant(i64, 1))
    j.add_incoming(j_next, end)
    for row_a, row_new in zip(accs, new):
        for a, x in zip(row_a, row_new):
            a.add_incoming(x, end)
    builder.cbranch(builder.icmp_signed("<", j_next, n), loop, done)
    builder.position_at_end(done)
    result = []
    for row_init, row_new in zip(init, new):
        result.append([])
        for x0, x in zip(row_init, row_new):
            ph = builder.phi(x0.type)
            ph.add_incoming(x0, entry)
            ph.add_incoming(x, end)
            result[-1].append(ph)
    return result


def store_rows(builder, rows, ptrs):
    """Store rows of vectors ``rows`` at the matching rows of pointers ``ptrs``."""
    for row, row_ptrs in zip(rows, ptrs):
        for x, a in zip(row, row_ptrs):
            builder.store(x, a, align=4)


def rows_pv(n_rows, n_vec, width):
    """Make an intrinsic ``f(acc, acc_stride, p, p_stride, vbase, voff, vh, n)``: for the rows
    ``r < n_rows``, ``acc[r * acc_stride + d] += p[r * p_stride + j] * v_j[d]`` for the keys
    ``j = 0 .. n - 1`` in order (one fused multiply-add each) and ``d < n_vec * width``, where
    ``v_j = vbase + voff[j] + vh``.

    The ``n_rows x n_vec`` accumulator vectors stay in registers over all ``n`` keys: each is
    loaded and stored once per call, each value vector is loaded once for the ``n_rows`` rows,
    and each weight once per key and row (a broadcast). Written as Numba loops, LLVM reloads the
    value vectors after every store to the accumulators (they might alias), so it loads about
    as often as it multiplies. The additions into one element are in key order: bitwise those of
    a loop ``acc[d] += p_j * v_j[d]`` contracted to fused multiply-adds.
    """
    @intrinsic
    def _rows_pv(typingctx, acc, acc_stride, p, p_stride, vbase, voff, vh, n):
        if not (isinstance(acc, types.CPointer) and acc == p == vbase
                and voff == types.CPointer(types.int64)
                and all(isinstance(t, types.Integer) for t in (acc_stride, p_stride, vh, n))):
            return None
        sig = types.void(acc, acc_stride, p, p_stride, vbase, voff, vh, n)

        def codegen(context, builder, signature, args):
            ap, _, pp, _, vb, vo, _, _ = args
            i64 = ir.IntType(64)
            as_, ps, vhv, nv = (context.cast(builder, args[i], signature.args[i], types.int64)
                                for i in (1, 3, 6, 7))
            ty = context.get_data_type(acc.dtype)
            vty = ir.VectorType(ty, width)
            fma = cgutils.get_or_insert_function(
                builder.module, ir.FunctionType(vty, [vty] * 3),
                f"llvm.fma.v{width}{'f32' if acc.dtype == types.float32 else 'f64'}")

            def vptr(base, off, v):
                return builder.bitcast(
                    builder.gep(base, [builder.add(off, ir.Constant(i64, v * width))]),
                    vty.as_pointer())

            aptrs = [[vptr(ap, builder.mul(as_, ir.Constant(i64, r)), v) for v in range(n_vec)]
                     for r in range(n_rows)]
            prows = [builder.gep(pp, [builder.mul(ps, ir.Constant(i64, r))])
                     for r in range(n_rows)]
            init = [[builder.load(a, align=4) for a in row] for row in aptrs]

            def step(j, accs):
                off = builder.add(builder.load(builder.gep(vo, [j])), vhv)
                vs = [builder.load(vptr(vb, off, v), align=4) for v in range(n_vec)]
                new = []
                for r in range(n_rows):
                    wv = splat(builder, builder.load(builder.gep(prows[r], [j])), vty)
                    new.append([builder.call(fma, [wv, vs[v], accs[r][v]])
                                for v in range(n_vec)])
                return new

            store_rows(builder, over_keys(builder, "rows_pv", init, nv, step), aptrs)
            return context.get_dummy_value()

        return sig, codegen

    return _rows_pv



def _load_compiled(module, name, argtypes, symbol):
    """Compile (or load from Numba's cache) ``module.name`` for ``argtypes``: run before a
    cached function that calls it by symbol (:func:`by_symbol`) is loaded.

    ``symbol`` is the name the caller was compiled against. Numba's names carry a number
    given per process: one loaded from the callee's cache entry saved with the caller's
    is the same, but a callee compiled again (its cache entry lost, or the process compiled
    it first) has another, so that name is made to point at it too (else the JIT could not
    resolve the caller's call, and aborts the process).
    """
    import importlib

    from llvmlite import binding

    disp = getattr(importlib.import_module(module), name)
    disp.compile(argtypes)
    cres = disp.overloads[argtypes]
    own = cres.fndesc.llvm_func_name
    if own != symbol:
        binding.add_symbol(symbol, cres.library.get_pointer_to_function(own))


def by_symbol(dispatcher):
    """A function of jitted code that calls ``dispatcher`` (a cached ``@njit`` function) as
    an external symbol, instead of linking a copy of its code into the caller.

    Numba links a callee's whole module into every caller's, and optimizes and emits machine
    code for it again there, at every level: the forward's row kernel went through LLVM eight
    times on a first call (its task, the task runner, the parfor's three wrappers, the
    kernel), half of the first call's 16 s. Called by symbol, it is compiled once, in its own
    library; the callers only declare it, and the JIT resolves the symbol to that library.
    Cached callers carry a reload hook (Numba's ``reload_init``, run before a cached function
    is loaded) that loads the callee first, from its own cache entry. The callee is compiled
    as before, from the same IR; only the callers no longer inline it (it is called once per
    task of rows, so the call costs nothing measurable), and the results keep their bits.
    """
    # Under NUMBA_DISABLE_JIT, njit gives back the Python function (the kernels refuse to
    # run then, see sdpa_numba._runtime.check_jit, but the package imports).
    py_func = getattr(dispatcher, "py_func", dispatcher)
    module, name = py_func.__module__, py_func.__name__

    def typer(typingctx, args):
        argtypes = tuple(types.unliteral(a) for a in args)
        dispatcher.compile(argtypes)
        cres = dispatcher.overloads[argtypes]
        hook = functools.partial(_load_compiled, module, name, argtypes,
                                 cres.fndesc.llvm_func_name)

        def codegen(context, builder, signature, llargs):
            library = context.active_code_library
            reload_init = getattr(library, "_reload_init", None)
            if reload_init is None:
                # A Numba without reload hooks (0.61): link the callee's code into the
                # caller, as a plain call does (no saving, the same results).
                library.add_linking_library(cres.library)
            else:
                reload_init.add(hook)
            return context.call_internal(builder, cres.fndesc, cres.signature, llargs)

        return cres.signature.return_type(*argtypes), codegen

    # Every parameter by name (Numba's intrinsics take no *args), all passed.
    params = ", ".join(inspect.signature(py_func).parameters)
    scope = {"typer": typer}
    exec(f"def {name}_by_symbol(typingctx, {params}):\n"
         f"    return typer(typingctx, ({params},))\n", scope)
    return intrinsic(scope[f"{name}_by_symbol"])


class _BFloat(ir.Type):
    """LLVM's ``bfloat`` (llvmlite's IR builder has no type for it): only to bitcast int16
    vectors to the operand type of the bfloat16 dot-product intrinsic."""

    def _to_string(self):
        return "bfloat"

    def __eq__(self, other):
        return isinstance(other, _BFloat)

    def __hash__(self):
        return hash(_BFloat)


#: Probe for :func:`has_pair_dot`: with AVX-512 BF16, LLVM converts 16 floats to bfloat16
#: with one ``vcvtneps2bf16``; without it, with integer code (never an error: the probe cannot
#: abort the process, which asking for the dot-product intrinsic itself would on a CPU that
#: lacks it).
_BF16_PROBE_IR = """
define <16 x bfloat> @probe(<16 x float> %a) {
  %c = fptrunc <16 x float> %a to <16 x bfloat>
  ret <16 x bfloat> %c
}
"""


def has_pair_dot(name=None, features=None):
    """Whether a CPU has AVX-512 BF16's ``vdpbf16ps`` (16 float32 lanes, each adding the two
    products of a pair of bfloat16), with 512-bit vectors.

    Parameters
    ----------
    name, features : str, optional
        The CPU name and LLVM feature string (``"+avx512bf16,-avx512vl,..."``) to ask about;
        by default those Numba's code generator compiles for, so that ``NUMBA_CPU_NAME`` /
        ``NUMBA_CPU_FEATURES`` are honoured (a feature the string leaves out takes the name's
        default).

    Returns
    -------
    bool
        Asked of LLVM for that target (see ``_BF16_PROBE_IR``); milliseconds.
    """
    return _selects(_BF16_PROBE_IR, "vcvtneps2bf16", name, features)


#: Probe for :func:`has_vnni`, in plain IR: the lane sums of pairs of products of int16 added to
#: an accumulator. With AVX-512 VNNI, LLVM makes it one ``vpdpwssd``; without, a ``vpmaddwd``
#: and an add, or 256-bit code (never an error: an x86 intrinsic, ``vpdpbusd``'s or even
#: ``vpmaddwd``'s, would abort the process on a CPU that lacks it).
_VNNI_PROBE_IR = """
define <16 x i32> @probe(<16 x i32> %acc, <32 x i16> %a, <32 x i16> %b) {
  %a32 = sext <32 x i16> %a to <32 x i32>
  %b32 = sext <32 x i16> %b to <32 x i32>
  %m = mul <32 x i32> %a32, %b32
  %e = shufflevector <32 x i32> %m, <32 x i32> poison, <16 x i32> <EVEN>
  %o = shufflevector <32 x i32> %m, <32 x i32> poison, <16 x i32> <ODD>
  %s = add <16 x i32> %e, %o
  %r = add <16 x i32> %acc, %s
  ret <16 x i32> %r
}
""".replace("EVEN", ", ".join(f"i32 {2 * i}" for i in range(16))).replace(
    "ODD", ", ".join(f"i32 {2 * i + 1}" for i in range(16)))


def has_vnni(name=None, features=None):
    """Whether a CPU has AVX-512 VNNI's integer dot products (``vpdpwssd``: 16 int32 lanes,
    each adding two products of int16; ``vpdpbusd``: four of an unsigned and a signed byte),
    with 512-bit vectors.

    Parameters
    ----------
    name, features : str, optional
        As :func:`has_pair_dot`: by default the CPU and features Numba's code generator
        compiles for (``NUMBA_CPU_NAME`` / ``NUMBA_CPU_FEATURES`` honoured).

    Returns
    -------
    bool
        Asked of LLVM for that target (see ``_VNNI_PROBE_IR``); milliseconds.
    """
    return _selects(_VNNI_PROBE_IR, "vpdpwssd", name, features)


def _selects(probe_ir, mnemonic, name, features):
    """Whether LLVM compiles ``probe_ir`` for that CPU with the 512-bit ``mnemonic``."""
    asm = probe_assembly(probe_ir, name, features)
    return mnemonic in asm and "zmm" in asm


def pair_dots(n_rows, n_vec):
    """Make an intrinsic ``f(a, a_rs, b, c, n_pairs)``: ``c[r * 16 * n_vec + l] = sum over p <
    n_pairs of a_r[2p] * b[p, l, 0] + a_r[2p + 1] * b[p, l, 1]`` for the rows ``r < n_rows``
    and lanes ``l < 16 * n_vec``, where ``a_r = a + r * a_rs``: bfloat16 bit patterns (int16
    pointers), ``b`` packed as pairs (lane ``l`` of pair ``p`` at ``b + p * 2 * BM + 2 * l``,
    BM = 64 lanes a pair), ``c`` float32 rows of 64 (BM) apart.

    One ``vdpbf16ps`` per 16 lanes and pair, from zero: each lane adds ``a[2p] * b[.., 0]``
    then ``a[2p + 1] * b[.., 1]`` (exact products of bfloat16; bfloat16 subnormals read as
    zero and float32 subnormal sums flushed to zero, as the instruction does). A pair of
    ``a_r`` is broadcast as one 32-bit load (no alignment needed); the ``n_rows x n_vec``
    accumulators stay in registers. Only for CPUs with :func:`has_pair_dot`: LLVM cannot
    select the instruction elsewhere.
    """
    lanes_per_pair = 64  # BM of the forward; the pair stride of b

    @intrinsic
    def _pair_dots(typingctx, a, a_rs, b, c, n_pairs):
        if not (a == b == types.CPointer(types.int16) and c == types.CPointer(types.float32)
                and isinstance(a_rs, types.Integer) and isinstance(n_pairs, types.Integer)):
            return None
        sig = types.void(a, a_rs, b, c, n_pairs)

        def codegen(context, builder, signature, args):
            ap, _, bp, cp, _ = args
            i64, i32 = ir.IntType(64), ir.IntType(32)
            ars, npairs = (context.cast(builder, args[i], signature.args[i], types.int64)
                           for i in (1, 4))
            fv = ir.VectorType(ir.FloatType(), 16)
            iv = ir.VectorType(ir.IntType(16), 32)
            bv = ir.VectorType(_BFloat(), 32)
            dot = cgutils.get_or_insert_function(
                builder.module, ir.FunctionType(fv, [fv, bv, bv]),
                "llvm.x86.avx512bf16.dpbf16ps.512")
            rows = [builder.bitcast(builder.gep(ap, [builder.mul(ars, ir.Constant(i64, r))]),
                                    i32.as_pointer()) for r in range(n_rows)]
            b32 = builder.bitcast(bp, iv.as_pointer())
            init = [[ir.Constant(fv, None)] * n_vec for _ in range(n_rows)]

            def step(p, accs):
                # Pair p: 32 bits at a_r + 2p (i32 index p), lanes at b + p * 2 * 64 int16
                # (each <32 x i16> vector holds 16 lanes' pairs).
                bvs = [builder.bitcast(builder.load(
                    builder.gep(b32, [builder.add(builder.mul(p, ir.Constant(
                        i64, lanes_per_pair // 16)), ir.Constant(i64, v))]), align=2), bv)
                    for v in range(n_vec)]
                new = []
                for r in range(n_rows):
                    x = builder.load(builder.gep(rows[r], [p]), align=2)
                    xv = builder.bitcast(splat(builder, x, ir.VectorType(i32, 16)), bv)
                    new.append([builder.call(dot, [accs[r][v], xv, bvs[v]])
                                for v in range(n_vec)])
                return new

            out = over_keys(builder, "pair_dots", init, npairs, step)
            for r in range(n_rows):
                for v in range(n_vec):
                    ptr = builder.gep(cp, [ir.Constant(i64, r * lanes_per_pair + 16 * v)])
                    builder.store(out[r][v], builder.bitcast(ptr, fv.as_pointer()), align=4)
            return context.get_dummy_value()

        return sig, codegen

    return _pair_dots
