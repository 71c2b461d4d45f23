#!/usr/bin/env python
"""Compile every variant of the CUDA kernels to PTX without a GPU, and summarize it.

The CUDA simulator runs kernels as Python, so it never type-checks them for the device: this
does. Needs the CUDA compiler wheels (``pip install "numba-cuda[cu13]"``), no GPU and no driver.

    python scripts/ptx_check.py [--cc 9.0] [--out DIR]

For each kernel (the forward; the backward's dQ and dK/dV kernels) and each (dtype, mask kind)
of two default tilings it prints the compile time, the number of PTX instructions (static, as
written: to compare two versions of a kernel's code, not their speed) and counts of those
worth reading before spending device time: shared-memory loads, local-memory traffic
(register arrays that spilled), float64 instructions in float32 kernels, fast exponentials,
FMAs and 64-bit integer divisions. ``--kernels forward`` (or ``dq``, ``dkv``) restricts the list.

``--variants`` compiles the score recipe's variants instead (float32, one tiling, no mask and
an additive mask): plain attention (whose kernel also runs windows, alignments and soft caps:
they are run-time numbers), ALiBi, sinks, a user score_mod with its score_mod_grad and a
mod_args table, a user mask_mod (document ids), a mask_mod with a block mask, and all at once.
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
    ap.add_argument("--kernels", default="forward,dq,dkv",
                    help="comma-separated: forward, dq, dkv (default: all)")
    ap.add_argument("--variants", action="store_true",
                    help="compile every variant of the score recipe (float32) instead")
    args = ap.parse_args(argv)
    cc = tuple(int(x) for x in args.cc.split("."))
    sys.path.insert(0, ROOT)

    import numpy as np
    from numba import cuda
    import numba.cuda.dispatcher as dispatcher

    class _Device:  # device functions ask the current device for its compute capability
        compute_capability = cc

    dispatcher.get_current_device = lambda: _Device()
    fw = importlib.import_module("sdpa_numba.gpu.forward")
    bw = importlib.import_module("sdpa_numba.gpu.backward")
    from sdpa_numba.gpu.options import FASTMATH, Blocks

    class _Uncompiled:
        def __init__(self, f):
            self.py_func = f

    real_jit = cuda.jit

    def uncompiled_jit(sig=None, **kw):  # the kernel factories compile eagerly: keep py_func
        if kw.get("device"):  # device functions the kernels call: compiled with them
            return real_jit(sig, **kw)
        return lambda f: _Uncompiled(f)

    from sdpa_numba.gpu.variants import compile_key
    from sdpa_numba.score.recipe import DENSE

    kernels = {  # name: (factory(dtype, mask_kind, blocks, ev, parts), signature)
        "forward": (lambda dt, mk, blocks, ev, parts: fw._make_kernel(
            dt, mk, blocks, blocks.out_cols(ev), parts), fw._signature),
        # "additive+grad": the dQ kernel that also writes the mask's gradient
        "dq": (lambda dt, mk, blocks, ev, parts: bw._make_dq_kernel(
            dt, mk.split("+")[0], blocks, parts, mk.endswith("+grad")),
               lambda dt, mk, parts: bw.dq_signature(dt, mk.split("+")[0], parts,
                                                     mk.endswith("+grad"))),
        "dkv": (lambda dt, mk, blocks, ev, parts: bw._make_dkv_kernel(dt, mk, blocks, parts),
                bw.dkv_signature),
    }
    if args.variants:
        cases = [(blocks, 64, np.float32, mask_kind, name, compile_key(r))
                 for name, r in variant_recipes().items()
                 for blocks in (Blocks(64, 32, 256, 4),)
                 for mask_kind in ("none", "additive")]
    else:
        # int16: bfloat16 storage, as the launchers pass it (sdpa_numba.gpu.storage)
        cases = [(blocks, ev, dtype, mask_kind, None, compile_key(DENSE))
                 for blocks, ev in ((Blocks(64, 32, 256, 4), 64), (Blocks(32, 16, 128, 4), 128))
                 for dtype in (np.float16, np.int16, np.float32, np.float64)
                 for mask_kind in ("none", "bool", "additive", "additive+grad")]
    for which in args.kernels.split(","):
        factory, signature = kernels[which]
        for blocks, ev, dtype, mask_kind, variant, parts in cases:
            if mask_kind.endswith("+grad") and which != "dq":
                continue
            if True:
                if True:
                    cuda.jit = uncompiled_jit
                    try:
                        kernel = factory(np.dtype(dtype), mask_kind, blocks, ev, parts)
                    finally:
                        cuda.jit = real_jit
                    sig, _ = signature(np.dtype(dtype), mask_kind, parts)
                    t0 = time.perf_counter()
                    ptx, _ = cuda.compile_ptx(kernel.py_func, sig.args, cc=cc,
                                              fastmath=FASTMATH, launch_bounds=blocks.threads)
                    dt_name = "bfloat16" if dtype is np.int16 else np.dtype(dtype).name
                    name = (f"{which}-{dt_name}-{mask_kind}-{blocks.block_m}x"
                            f"{blocks.block_n}-ev{ev}" + (f"-{variant}" if variant else ""))
                    if args.out:
                        os.makedirs(args.out, exist_ok=True)
                        with open(os.path.join(args.out, name + ".ptx"), "w") as f:
                            f.write(ptx)
                    lines = ptx.splitlines()

                    def count(*words):
                        return sum(any(w in line for w in words) for line in lines)

                    # instructions: indented lines that are neither directives nor comments
                    n_instr = sum(1 for line in lines if line[:1] == "\t"
                                  and line.strip()[:1] not in ("", ".", "/", "{", "}"))
                    print(f"{name:36} {time.perf_counter() - t0:5.1f}s  instr {n_instr:5}  "
                          f"ld.shared {count('ld.shared'):4}  "
                          f"local {count('ld.local', 'st.local'):3}  "
                          f"f64 {count('.f64'):4}  ex2.approx {count('ex2.approx'):3}  "
                          f"fma {count('fma.rn'):4}  div.64 {count('div.s64', 'div.u64'):3}",
                          flush=True)
    return 0


def variant_recipes():
    """Recipes of every variant the kernels compile differently (float32 parts)."""
    import numpy as np
    from numba import njit

    from sdpa_numba.score.recipe import DENSE, recipe

    # Every function gets every mod_args entry: (bias table, document ids).
    @njit
    def capped(s, b, h, i, j, bias, doc):  # soft cap plus a relative-position bias table
        return 20.0 * np.tanh(s / 20.0) + bias[h, i - j + bias.shape[1] // 2]

    @njit
    def capped_grad(s, b, h, i, j, bias, doc):
        t = np.tanh(s / 20.0)
        return 1.0 - t * t

    @njit
    def same_document(b, h, i, j, bias, doc):
        return doc[b, i] == doc[b, j]

    bias = np.zeros((2, 9), np.float32)
    doc = np.zeros((1, 8), np.int32)
    slopes = np.ones((1, 2), np.float32)
    sinks = np.zeros(2, np.float32)
    bm = np.zeros((1, 1, 1, 1), np.int8)
    return {
        "dense": DENSE,
        "alibi": recipe(alibi=slopes),
        "sinks": recipe(sinks=sinks),
        "score_mod": recipe(score_mod=capped, score_mod_grad=capped_grad,
                            mod_args=(bias, doc)),
        "mask_mod": recipe(mask_mod=same_document, mod_args=(bias, doc)),
        "block_mask": recipe(mask_mod=same_document, mod_args=(bias, doc), block_mask=bm),
        "all": recipe(left=5, right=0, softcap=30.0, alibi=slopes, sinks=sinks,
                      score_mod=capped, score_mod_grad=capped_grad, mask_mod=same_document,
                      mod_args=(bias, doc), block_mask=bm),
    }


if __name__ == "__main__":
    sys.exit(main())
