"""Where the CPU decode kernel's time goes per (key, head), by cache format (issue 29).

For float32, float16, int8 (per-token scales), q8_0 and fp8 (e4m3fn, e5m2) caches of the same
tokens, float32 queries, MHA (or GQA with ``--gqa``) D128, it times ``attention_with_kvcache``:

* **compute alone**: a small cache (``--small`` keys x ``--heads`` heads; the float32 one fits
  in L2) called over and over, on one thread (CPU time, as the one-thread figures below: on a
  shared machine wall time counts other jobs); the time of a one-key call (the call's fixed
  cost) is taken off, and the rest divided by keys x heads;
* **from memory**: a long cache (``--long`` keys), on one thread and on all of Numba's threads
  (ns per (key, head) of wall time, and the bytes read per second).

Each figure is the minimum over ``--repeats`` rounds. A format is bound by compute where its
compute-alone ns on one thread is near its from-memory ns on one thread, and by memory where
the from-memory ns is well above it.

``--micro`` times the int8 score intrinsics alone instead (ns per (key, head), CPU time of
one thread): 16 keys of ``--dim`` in L1, scored over and over by the float loop
(:func:`sdpa_numba.cpu.quant.q_lane_dots`, one row x 16 keys and four rows x four keys) and,
where the CPU has AVX-512 VNNI, by the integer one (:func:`sdpa_numba.cpu.int_dots.
vnni_lane_dots`, one row x 16 keys, as decode uses it); the buffers 64-byte aligned.

    nice -n 5 python scripts/quant_decode_profile.py [--gqa] [--formats int8,q8_0] [--micro]
"""

import argparse
import time

import numba
import numpy as np

from sdpa_numba import attention_with_kvcache, quantize_kv

FORMATS = ("float32", "float16", "int8", "q8_0", "e4m3fn", "e5m2")


def make_call(fmt, q, k, v, lens):
    """A zero-argument call of ``attention_with_kvcache`` over a ``fmt`` cache of ``k``, ``v``,
    and the bytes per (key, head) it reads (keys, values and their scales)."""
    d = k.shape[-1]
    if fmt == "float32":
        return (lambda: attention_with_kvcache(q, k, v, lens)), 8 * d
    if fmt == "float16":
        k16, v16, q16 = k.astype(np.float16), v.astype(np.float16), q.astype(np.float16)
        return (lambda: attention_with_kvcache(q16, k16, v16, lens)), 4 * d
    sd = np.float16 if fmt == "q8_0" else np.float32
    kq, ks = quantize_kv(k, fmt, scale_dtype=sd)
    vq, vs = quantize_kv(v, fmt, scale_dtype=sd)
    extra = {"int8": 8, "q8_0": 4 * d // 32}.get(fmt, 0)
    return (lambda: attention_with_kvcache(q, kq, vq, lens, k_scale=ks, v_scale=vs)), 2 * d + extra


def best_time(fn, repeats, inner, clock=time.perf_counter):
    """The least time of one call, over ``repeats`` rounds of ``inner`` calls each, by
    ``clock``."""
    fn()
    best = np.inf
    for _ in range(repeats):
        t0 = clock()
        for _ in range(inner):
            fn()
        best = min(best, (clock() - t0) / inner)
    return best


def _aligned(a):
    """A 64-byte aligned copy of ``a``."""
    buf = np.empty(a.nbytes + 64, np.uint8)
    o = (-buf.ctypes.data) % 64
    out = buf[o:o + a.nbytes].view(a.dtype).reshape(a.shape)
    out[...] = a
    return out


def micro(dim, repeats, calls=1_000_000):
    """Print the ns per (key, head) of the int8 score intrinsics alone (see the module doc)."""
    from numba import njit

    from sdpa_numba.cpu import int_dots
    from sdpa_numba.cpu._llvm import data_ptr, prefer_512_bit
    from sdpa_numba.cpu.quant import FMT_INT8, q_lane_dots

    rng = np.random.default_rng(0)
    q = _aligned(rng.standard_normal(4 * dim).astype(np.float32))
    keys = _aligned(rng.integers(-127, 128, 16 * dim).astype(np.int8))
    koff = (np.arange(16) * dim).astype(np.int64)
    sc = _aligned(rng.random(32).astype(np.float32))
    out = _aligned(np.zeros(16, np.float32))

    def float_loop(n_rows, n_keys):
        f = q_lane_dots(n_rows, n_keys, 16, FMT_INT8, None)

        @njit
        def run(q, keys, koff, sc, out, n):  # arguments: captured arrays are constants
            prefer_512_bit()
            for it in range(n):
                f(data_ptr(q), dim, data_ptr(keys), data_ptr(koff), it & 0, dim, data_ptr(sc),
                  32, data_ptr(out))
            return out[0]
        return lambda n: run(q, keys, koff, sc, out, n)

    cases = [("float loop, 1 row x 16 keys", float_loop(1, 16)),
             ("float loop, 4 rows x 4 keys", float_loop(4, 4))]
    if int_dots.HAS_VNNI:
        dig = _aligned(np.zeros(4 * 2 * dim, np.int16))
        fac = np.zeros(8, np.float32)
        f = int_dots.vnni_lane_dots(1, 16, 8)

        @njit
        def prep(q, dig, fac):  # arguments: the arrays a jitted function captures are frozen
            int_dots.prepare_rows(data_ptr(q), 4, dim, dig, fac)

        @njit
        def vnni(dig, fac, keys, koff, sc, out, n):
            prefer_512_bit()
            for it in range(n):
                f(data_ptr(dig), 2 * dim, data_ptr(fac), data_ptr(keys), data_ptr(koff),
                  it & 0, dim, data_ptr(sc), data_ptr(out))
            return out[0]
        prep(q, dig, fac)
        cases.append(("VNNI, 1 row x 16 keys",
                      lambda n: vnni(dig, fac, keys, koff, sc, out, n)))
    print(f"int8 scores alone, D{dim}, 16 keys in L1, ns per (key, head), 1 thread CPU time")
    for name, run in cases:
        run(10)
        t = best_time(lambda: run(calls), repeats, 1, time.process_time)
        print(f"{name:30} {t / calls / 16 * 1e9:6.2f}", flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--heads", type=int, default=8, help="key/value heads of the small cache")
    ap.add_argument("--small", type=int, default=128, help="keys of the in-cache case")
    ap.add_argument("--long", type=int, default=8192, help="keys of the from-memory case")
    ap.add_argument("--long-heads", type=int, default=32)
    ap.add_argument("--gqa", action="store_true", help="4 query heads per key/value head")
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--formats", default=",".join(FORMATS))
    ap.add_argument("--micro", action="store_true",
                    help="time the int8 score intrinsics alone (module doc)")
    args = ap.parse_args()
    if args.micro:
        micro(args.dim, args.repeats)
        return
    g = 4 if args.gqa else 1
    rng = np.random.default_rng(0)
    threads = numba.get_num_threads()
    print(f"D{args.dim} {'GQA g4' if args.gqa else 'MHA'}; compute alone: H{args.heads} "
          f"S{args.small} (minus S1), 1 thread; from memory: H{args.long_heads} S{args.long}")
    print(f"{'format':8} {'B/(key,head)':>12} {'compute ns':>10} {'memory ns 1t':>12} "
          f"{'memory ns {}t'.format(threads):>12} {'GB/s {}t'.format(threads):>9}")
    for fmt in args.formats.split(","):
        def case(h, s):
            q = rng.standard_normal((1, 1, h * g, args.dim)).astype(np.float32)
            k = rng.standard_normal((1, s, h, args.dim)).astype(np.float32)
            v = rng.standard_normal((1, s, h, args.dim)).astype(np.float32)
            return make_call(fmt, q, k, v, np.array([s], np.int64))
        small, nbytes = case(args.heads, args.small)
        one, _ = case(args.heads, 1)
        long, _ = case(args.long_heads, args.long)
        numba.set_num_threads(1)
        try:
            cpu = time.process_time  # one thread: its CPU time, less the machine's load
            t_small = best_time(small, args.repeats, 200, cpu)
            t_one = best_time(one, args.repeats, 200, cpu)
            t_long1 = best_time(long, args.repeats, 2, cpu)
        finally:
            numba.set_num_threads(threads)
        t_long = best_time(long, args.repeats, 3)
        kh_small = args.small * args.heads
        kh_long = args.long * args.long_heads
        print(f"{fmt:8} {nbytes:12d} {(t_small - t_one) / kh_small * 1e9:10.2f} "
              f"{t_long1 / kh_long * 1e9:12.2f} {t_long / kh_long * 1e9:12.2f} "
              f"{nbytes * kh_long / t_long / 1e9:9.1f}", flush=True)


if __name__ == "__main__":
    main()
