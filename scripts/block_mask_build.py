#!/usr/bin/env python
"""What the block mask built per call saves: a document mask through ``mask_mod``.

Times, in one process and interleaved (minimum of ``--rounds`` after warm-up), the forward
(and with ``--backward`` the backward) of a ``mask_mod`` on document ids, B1, ``--docs``
equal documents, float32, at each ``--L`` (L = S):

* ``per element``: no block mask (every block partial: the mask_mod at every score);
* ``built per call``: the call builds its block mask (the default above
  ``sdpa_numba.problem.block_mask.BUILD_MIN_SCORES``);
* ``passed in``: a block mask from ``create_block_mask``, made once;
* ``dense``: no mask at all, and ``ideal``: dense time x the visited fraction of the blocks;

and the time of building the states alone. Usage::

    python scripts/block_mask_build.py --L 2048 --heads 8 --D 64
    python scripts/block_mask_build.py --L 64 128 256 512 --heads 8 --backward
"""

import argparse
import time

import numpy as np
from numba import njit


@njit
def same_doc(b, h, i, j, doc):
    return doc[i] == doc[j]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--L", type=int, nargs="+", default=[2048])
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--D", type=int, default=64)
    ap.add_argument("--docs", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--backward", action="store_true")
    args = ap.parse_args(argv)

    import sdpa_numba
    from sdpa_numba.problem import block_mask as bmod
    from sdpa_numba.score.recipe import NO_LIMIT

    rng = np.random.default_rng(0)
    for L in args.L:
        q, k, v, g = (rng.standard_normal((1, args.heads, L, args.D)).astype(np.float32)
                      for _ in range(4))
        doc = np.arange(L) * args.docs // L
        passed = sdpa_numba.create_block_mask(same_doc, None, None, L, L, mod_args=(doc,))

        def run(**kw):
            if args.backward:
                out, lse = sdpa_numba.scaled_dot_product_attention(q, k, v, return_lse=True,
                                                                   **kw)
                return lambda: sdpa_numba.scaled_dot_product_attention_backward(
                    g, q, k, v, out, lse, **kw)
            return lambda: sdpa_numba.scaled_dot_product_attention(q, k, v, **kw)

        saved = bmod.BUILD_MIN_SCORES
        cases = {
            "per element": (run(mask_mod=same_doc, mod_args=(doc,)), float("inf")),
            "built per call": (run(mask_mod=same_doc, mod_args=(doc,)), 0),
            "passed in": (run(block_mask=passed, mod_args=(doc,)), saved),
            "dense": (run(), saved),
        }
        best = {name: float("inf") for name in cases}
        states = np.empty(passed.states.shape, np.int8)
        best["building alone"] = float("inf")
        try:
            for rnd in range(args.rounds + 1):
                for name, (f, threshold) in cases.items():
                    bmod.BUILD_MIN_SCORES = threshold
                    time.sleep(0.05)
                    t0 = time.perf_counter()
                    f()
                    dt = time.perf_counter() - t0
                    if rnd:
                        best[name] = min(best[name], dt)
                time.sleep(0.05)
                t0 = time.perf_counter()
                bmod._states(same_doc, 1, 1, L, L, (doc,), 0, NO_LIMIT, NO_LIMIT, states)
                if rnd:
                    best["building alone"] = min(best["building alone"],
                                                 time.perf_counter() - t0)
        finally:
            bmod.BUILD_MIN_SCORES = saved
        visited = float(np.count_nonzero(passed.states != sdpa_numba.BLOCK_EMPTY)
                        ) / passed.states.size
        best["ideal"] = best["dense"] * visited
        print(f"{'backward' if args.backward else 'forward'} B1 H{args.heads} L=S={L} "
              f"D{args.D} float32, {args.docs} documents, visited blocks {visited:.3f}")
        for name, t in best.items():
            print(f"  {name:16s} {t * 1e3:9.3f} ms  {t / best['per element']:6.3f} of per "
                  f"element")


if __name__ == "__main__":
    main()
