#!/usr/bin/env python
"""Per-phase cost of the CPU forward's inner loop, on one thread, per (query row, key).

Calls each phase of :func:`sdpa_numba.cpu.forward.attend_rows`' inner loop in a jitted loop
on one BM x BN tile (warm in cache, as the forward streams them): the score tile Sᵀ = K Qᵀ
(``_scores``), the online softmax with exp2 (``_softmax_tile``), P·V (``_accumulate``); then
the whole ``forward_head`` at L = S, whose remainder over the three is packing, masks and the
output write (a difference of noisy figures: it can come out negative). Timed by the thread's
CPU time (``time.thread_time``), which other tenants of a shared machine disturb far less than
wall time; each figure is the minimum over ``--rounds``.
Reports ns and cycles (at ``--ghz``) per (row, key), and GFLOP/s of the two products against a
one-thread sgemm (``torch.mm`` of ``--sgemm`` squared float32) timed the same way.

Usage::

    python scripts/phase_profile.py --D 64 --L 2048
    python scripts/phase_profile.py --D 128 --L 4096 --ghz 3.0
"""

import argparse
import os
import time

os.environ.setdefault("NUMBA_NUM_THREADS", "1")

import numpy as np  # noqa: E402
from numba import njit  # noqa: E402


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--D", type=int, default=64, help="head dim E = Ev (default 64)")
    ap.add_argument("--L", type=int, default=2048, help="L = S of the whole forward")
    ap.add_argument("--rounds", type=int, default=7, help="timings per figure (min kept)")
    ap.add_argument("--reps", type=int, default=2000, help="tile calls per timing")
    ap.add_argument("--ghz", type=float, default=0.0,
                    help="core clock for cycles (default: read from /proc/cpuinfo)")
    ap.add_argument("--sgemm", type=int, default=1024, help="N of the sgemm roof")
    ap.add_argument("--causal", action="store_true", help="the whole forward causal")
    return ap.parse_args(argv)


def _ghz():
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("cpu MHz"):
                    return float(line.split(":")[1]) / 1000
    except OSError:
        pass
    return 1.0


def _best(f, rounds):
    t = []
    for _ in range(rounds):
        t0 = time.thread_time()
        f()
        t.append(time.thread_time() - t0)
    return min(t)


def main(argv=None):
    args = parse_args(argv)
    import importlib
    # the module, not the package's ``forward`` kernel of the same name
    fw = importlib.import_module("sdpa_numba.cpu.forward")
    from sdpa_numba.cpu._llvm import data_ptr, keep_alive
    from sdpa_numba.cpu.microkernel import WIDE_VECTORS

    BM, BN = fw.BM, fw.BN
    D = args.D
    ev_pad = (D + 3) // 4 * 4
    rng = np.random.default_rng(0)
    kb = rng.standard_normal((BN, D), dtype=np.float32)
    qt = rng.standard_normal((D, BM), dtype=np.float32) / np.float32(np.sqrt(D))
    vb = rng.standard_normal((BN, ev_pad), dtype=np.float32)
    st = np.zeros(BN * BM, np.float32)
    acc = np.zeros(ev_pad * BM, np.float32)
    m = np.full(BM, -np.inf, np.float32)
    l = np.zeros(BM, np.float32)
    alpha = np.ones(BM, np.float32)
    scores, softmax, accumulate = fw._scores, fw._softmax_tile, fw._accumulate

    @njit(fastmath=True)
    def phase(which, reps, kb, qt, vb, st, acc, m, l, alpha):
        p_st, p_m, p_l, p_a = data_ptr(st), data_ptr(m), data_ptr(l), data_ptr(alpha)
        zero = np.float32(0.0)
        for _ in range(reps):
            if which == 0:
                scores(data_ptr(kb), kb.shape[1], kb.shape[1], data_ptr(qt), p_st, BN, BM)
            elif which == 1:
                # from the second call on, the tile holds p <= 1 below m: a steady state
                softmax(p_st, BN, p_m, p_l, p_a, zero, False, 0, 0)
            else:
                accumulate(p_st, data_ptr(vb), vb.shape[1], vb.shape[1], data_ptr(acc),
                           p_a)
        keep_alive((kb, qt, vb, st, acc, m, l, alpha))

    ghz = args.ghz or _ghz()
    pairs = BM * BN
    print(f"AVX-512 tiles: {WIDE_VECTORS}; D = {D}; clock {ghz:.2f} GHz (cycles = ns x clock)")
    names = ("Q·Kᵀ (_scores)", "softmax+exp2 (_softmax_tile)", "P·V (_accumulate)")
    ns = {}
    for which, name in enumerate(names):
        phase(which, 1, kb, qt, vb, st, acc, m, l, alpha)
        t = _best(lambda: phase(which, args.reps, kb, qt, vb, st, acc, m, l, alpha),
                  args.rounds)
        ns[which] = t / args.reps / pairs * 1e9
        flops = 2 * D if which != 1 else 0
        gf = f"  {flops / ns[which]:6.1f} GFLOP/s" if flops else ""
        print(f"{name:32s} {ns[which]:7.4f} ns  {ns[which] * ghz:6.3f} cyc/(row,key){gf}")

    import torch
    torch.set_num_threads(1)
    n = args.sgemm
    a = torch.randn(n, n)
    b = torch.randn(n, n)
    c = torch.empty(n, n)
    torch.mm(a, b, out=c)
    reps = max(1, int(2e10 / (2 * n ** 3)))
    t = _best(lambda: [torch.mm(a, b, out=c) for _ in range(reps)], args.rounds) / reps
    sg = 2 * n ** 3 / t / 1e9
    print(f"sgemm {n}² (torch, 1 thread)         {sg:6.1f} GFLOP/s = "
          f"{2 * D / sg:.4f} ns per (row, key) of each product")

    L = args.L
    q = rng.standard_normal((L, D), dtype=np.float32)
    k = rng.standard_normal((L, D), dtype=np.float32)
    v = rng.standard_normal((L, D), dtype=np.float32)
    out = np.empty((L, D), np.float32)
    lse = np.empty(L, np.float32)
    fh = fw.forward_head
    fh(q, k, v, None, args.causal, 1 / np.sqrt(D), out, lse)
    t = _best(lambda: fh(q, k, v, None, args.causal, 1 / np.sqrt(D), out, lse), args.rounds)
    n_pairs = L * L / (2 if args.causal else 1)
    whole = t / n_pairs * 1e9
    rest = whole - sum(ns.values())
    print(f"whole forward_head L={L}{' causal' if args.causal else ''}"
          f"       {whole:7.4f} ns  {whole * ghz:6.3f} cyc  {4 * D / whole:6.1f} GFLOP/s "
          f"({4 * D / whole / sg:.0%} of sgemm)")
    print(f"  rest (packing, masks, output)  {rest:7.4f} ns  {rest * ghz:6.3f} cyc")
    torch_t = None
    try:
        import torch.nn.functional as F
        tq, tk, tv = (torch.from_numpy(x)[None, None] for x in (q, k, v))
        F.scaled_dot_product_attention(tq, tk, tv, is_causal=args.causal)
        torch_t = _best(lambda: F.scaled_dot_product_attention(tq, tk, tv,
                                                               is_causal=args.causal),
                        args.rounds)
    except Exception as e:  # noqa: BLE001
        print("torch SDPA failed:", e)
    if torch_t:
        print(f"torch SDPA 1 thread                {torch_t / n_pairs * 1e9:7.4f} ns "
              f" ratio torch/ours {torch_t / t:.3f}")


if __name__ == "__main__":
    main()
