"""Measure the CPU kernels' worst errors against the float64 reference: the numbers behind the
tolerances of tests/checks.py (TOL, LSE_EPS, F16_EXCESS).

    PYTHONPATH=. python scripts/measure_errors.py [--trials 150] [--seed 123]

Per dtype, over random problems (L, S in 1..200 around the block sizes, E in 1..64, Ev in
1..33, causal or not, no / bool / additive mask with -inf entries), prints the worst:
relative Frobenius error of the output; lse error in eps of the compute dtype times
max(1, |lse|); for float16, the error beyond half a float16 ulp in eps32 * max|v|.
"""

import argparse

import numpy as np

from sdpa_numba import scaled_dot_product_attention as sdpa
from sdpa_numba.reference import attention

COMPUTE_EPS = {np.float16: np.finfo(np.float32).eps, np.float32: np.finfo(np.float32).eps,
               np.float64: np.finfo(np.float64).eps}
SIZES = [1, 2, 3, 5, 17, 63, 64, 65, 127, 129, 200]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trials", type=int, default=150, help="problems per dtype")
    ap.add_argument("--seed", type=int, default=123)
    args = ap.parse_args(argv)
    rng = np.random.default_rng(args.seed)
    worst = {t: dict(rel=0.0, lse_eps=0.0, f16_excess=0.0) for t in COMPUTE_EPS}
    for _ in range(args.trials):
        for dtype in (np.float16, np.float32, np.float64):
            L, S = rng.choice(SIZES), rng.choice(SIZES)
            E, Ev = rng.choice([1, 3, 16, 33, 64]), rng.choice([1, 5, 16, 33])
            kw = dict(is_causal=bool(rng.integers(2)))
            kind = ["none", "bool", "additive"][rng.integers(3)]
            q = rng.standard_normal((2, 2, L, E)).astype(dtype)
            k = rng.standard_normal((2, 2, S, E)).astype(dtype)
            v = rng.standard_normal((2, 2, S, Ev)).astype(dtype)
            if kind == "bool":
                kw["attn_mask"] = rng.random((L, S)) < 0.8
            elif kind == "additive":
                m = rng.standard_normal((L, S))
                m[rng.random((L, S)) < 0.1] = -np.inf
                kw["attn_mask"] = m.astype(dtype)
            out, lse = sdpa(q, k, v, return_lse=True, **kw)
            ref, ref_lse = attention(q, k, v, **kw)
            eps = COMPUTE_EPS[dtype]
            w = worst[dtype]
            den = np.linalg.norm(ref)
            w["rel"] = max(w["rel"], np.linalg.norm(out.astype(np.float64) - ref) / (den or 1))
            fin = np.isfinite(ref_lse)
            if fin.any():
                e = np.abs(lse[fin] - ref_lse[fin]) / (eps * np.maximum(1, np.abs(ref_lse[fin])))
                w["lse_eps"] = max(w["lse_eps"], e.max())
            if dtype is np.float16 and out.size:
                half_ulp = 0.5 * np.spacing(np.abs(ref).astype(np.float16)).astype(np.float64)
                err = np.abs(out.astype(np.float64) - ref)
                ex = (err - half_ulp) / (eps * np.abs(v.astype(np.float64)).max())
                w["f16_excess"] = max(w["f16_excess"], ex.max())
    for t, w in worst.items():
        print(f"{t.__name__:8} rel {w['rel']:.3g}  lse {w['lse_eps']:.2f} eps"
              + (f"  float16 excess {w['f16_excess']:.2f} eps32 max|v|" if t is np.float16
                 else ""))


if __name__ == "__main__":
    main()
