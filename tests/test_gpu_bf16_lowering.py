"""The bfloat16 CUDA kernels type and lower for the real CUDA target, on a machine without a
GPU, CUDA driver or CUDA compiler.

The simulator runs the Python bodies of :mod:`sdpa_numba.gpu.storage`'s ``load``/``store``;
on the device, their ``@overload``s (libdevice bit casts, integer rounding) are compiled
instead, which no simulator test reaches. Here the three kernels (forward, dQ, dK/dV) for
int16 storage (bfloat16) go through Numba's CUDA front end and lowering to LLVM IR (as
scripts/ptx_check.py does, stopping before NVVM), in a subprocess without the simulator.
"""

import os
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("numba.cuda")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

SCRIPT = textwrap.dedent("""
    import importlib
    import numpy as np
    from numba import cuda, types
    import numba.cuda.dispatcher as dispatcher
    from numba.cuda import compiler

    class _Device:  # device functions ask the current device for its compute capability
        compute_capability = (9, 0)

    dispatcher.get_current_device = lambda: _Device()
    fw = importlib.import_module("sdpa_numba.gpu.forward")
    bw = importlib.import_module("sdpa_numba.gpu.backward")
    from sdpa_numba.gpu.options import FASTMATH, Blocks

    class _Uncompiled:
        def __init__(self, f):
            self.py_func = f

    real_jit = cuda.jit

    def uncompiled_jit(sig=None, **kw):  # the factories compile eagerly: keep py_func
        if kw.get("device"):
            return real_jit(sig, **kw)
        return lambda f: _Uncompiled(f)

    blocks = Blocks(32, 16, 128, 4)
    st = np.dtype(np.int16)
    made = {
        "forward": (lambda: fw._make_kernel(st, "additive", blocks, blocks.out_cols(64)),
                    fw._signature(st, "additive")[0]),
        "dq": (lambda: bw._make_dq_kernel(st, "additive", blocks),
               bw.dq_signature(st, "additive")[0]),
        "dkv": (lambda: bw._make_dkv_kernel(st, "additive", blocks),
                bw.dkv_signature(st, "additive")[0]),
    }
    for name, (make, sig) in made.items():
        cuda.jit = uncompiled_jit
        try:
            kernel = make()
        finally:
            cuda.jit = real_jit
        cres = compiler.compile_cuda(kernel.py_func, types.void, sig.args, cc=(9, 0),
                                     fastmath=FASTMATH)
        ir = cres.library.get_llvm_str()
        print(name, "nv_int_as_float" in ir, "nv_float_as_int" in ir)
""")


def test_bfloat16_kernels_lower_for_the_device():
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True,
                          env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = dict(line.split(" ", 1) for line in proc.stdout.splitlines())
    # every kernel reads bfloat16 (bit cast up); the forward also writes it (bit cast down)
    assert lines == {"forward": "True True", "dq": "True False", "dkv": "True False"}, lines
