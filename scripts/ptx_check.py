#!/usr/bin/env python
"""Compile every variant of the CUDA forward kernel to PTX without a GPU, and summarize it.

The CUDA simulator runs kernels as Python, so it never type-checks them for the device: this
does. Needs the CUDA compiler wheels (``pip install "numba-cuda[cu13]"``), no GPU and no driver.

    python scripts/ptx_check.py [--cc 9.0] [--out DIR]

For each (dtype, mask kind) of the default tilings it prints the compile time and counts of
PTX instructions worth reading before spending device time: shared-memory loads, local-memory
traffic (register arrays that spilled), float64 instructions in float32 kernels, fast
exponentials, FMAs and 64-bit integer divisions.
"""

import argparse
import importlib
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cc", default="9.0", help="compute capability (default 9.0)")
    ap.add_argument("--out", help="write each variant's PTX into this folder")
    args = ap.parse_args(argv)
    cc = tuple(int(x) for x in args.cc.split("."))
    sys.path.insert(0, ROOT)

    import numpy as np
    from numba import cuda
    import numba.cuda.dispatcher as dispatcher

    class _Device:  # device functions ask the current device for its compute capability
        compute_capability = cc

    dispatcher.get_current_device = lambda: _Device()
    fw = importlib.import_module("sdpa_numba.cuda.forward")
    from sdpa_numba.cuda.options import FASTMATH, Blocks

    class _Uncompiled:
        def __init__(self, f):
            self.py_func = f

    def uncompiled_jit(sig=None, **kw):  # the kernel factory compiles eagerly: keep py_func
        return lambda f: _Uncompiled(f)

    real_jit = cuda.jit
    for blocks, ev in ((Blocks(64, 32, 256, 4), 64), (Blocks(32, 16, 128, 4), 128)):
        for dtype in (np.float16, np.float32, np.float64):
            for mask_kind in ("none", "bool", "additive"):
                cuda.jit = uncompiled_jit
                try:
                    kernel = fw._make_kernel(np.dtype(dtype), mask_kind, blocks,
                                             blocks.out_cols(ev))
                finally:
                    cuda.jit = real_jit
                sig, _ = fw._signature(np.dtype(dtype), mask_kind)
                t0 = time.perf_counter()
                ptx, _ = cuda.compile_ptx(kernel.py_func, sig.args, cc=cc, fastmath=FASTMATH,
                                          launch_bounds=blocks.threads)
                name = (f"{np.dtype(dtype)}-{mask_kind}-{blocks.block_m}x{blocks.block_n}"
                        f"-ev{ev}")
                if args.out:
                    os.makedirs(args.out, exist_ok=True)
                    with open(os.path.join(args.out, name + ".ptx"), "w") as f:
                        f.write(ptx)
                lines = ptx.splitlines()

                def count(*words):
                    return sum(any(w in line for w in words) for line in lines)

                print(f"{name:32} {time.perf_counter() - t0:5.1f}s  "
                      f"ld.shared {count('ld.shared'):4}  "
                      f"local {count('ld.local', 'st.local'):3}  "
                      f"f64 {count('.f64'):4}  ex2.approx {count('ex2.approx'):3}  "
                      f"fma {count('fma.rn'):4}  div.64 {count('div.s64', 'div.u64'):3}",
                      flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
