"""The bfloat16 CUDA kernels type and lower for the real CUDA target, on a machine without a
GPU, CUDA driver or CUDA compiler.

The simulator runs the Python bodies of :mod:`sdpa_numba.gpu.storage`'s ``load``/``store``;
on the device, their ``@overload``s (libdevice bit casts, integer rounding) are compiled
instead, which no simulator test reaches. Here the three kernels (forward, dQ, dK/dV) for
int16 storage (bfloat16) go through Numba's CUDA front end and lowering to LLVM IR (as
scripts/ptx_check.py does, stopping before NVVM), in a subprocess without the simulator.
"""

import pytest

from device_lowering import run_lowering

pytest.importorskip("numba.cuda")

SCRIPT = """
    import importlib
    import numpy as np
    fw = importlib.import_module("sdpa_numba.gpu.forward")
    bw = importlib.import_module("sdpa_numba.gpu.backward")
    from sdpa_numba.gpu.options import Blocks

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
        ir = lowered_ir(make, sig)
        print(name, "nv_int_as_float" in ir, "nv_float_as_int" in ir)
"""


def test_bfloat16_kernels_lower_for_the_device():
    lines = dict(line.split(" ", 1) for line in run_lowering(SCRIPT).splitlines())
    # every kernel reads bfloat16 (bit cast up); the forward also writes it (bit cast down)
    assert lines == {"forward": "True True", "dq": "True False", "dkv": "True False"}, lines
