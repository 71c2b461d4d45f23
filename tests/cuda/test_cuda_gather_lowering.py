"""The data-movement kernels of :mod:`sdpa_numba.gpu.gather` type and lower for the real CUDA
target (cc 9.0, to LLVM IR, in a subprocess without the simulator), on a machine without a
GPU: the simulator runs their Python bodies, and storage's ``load``/``store`` overloads
(bfloat16 bits) only here."""

import pytest

from device_lowering import run_lowering

pytest.importorskip("numba.cuda")

SCRIPT = """
    import importlib
    from numba import types
    g = importlib.import_module("sdpa_numba.gpu.gather")

    def arr(dt, nd, layout="A"):
        return types.Array(dt, nd, layout)

    i64 = types.int64
    sigs = {
        "copy_u2": (g._copy, (arr(types.uint16, 6), arr(types.uint16, 6), i64)),
        "copy_u8": (g._copy, (arr(types.uint64, 6), arr(types.uint64, 6), i64)),
        "gather_u4": (g._gather, (arr(types.uint32, 3, "C"), arr(types.uint32, 4), arr(i64, 1),
                                  i64, i64)),
    }
    for dt in ("float16", "float32", "float64", "int16"):
        t = getattr(types, dt)
        sigs["scatter_" + dt] = (g._scatter_sum, (arr(t, 3, "C"), arr(t, 3, "C"),
                                                  arr(i64, 1, "C"), arr(i64, 1, "C"), i64))
    for name, (kernel, args) in sigs.items():
        ir = lowered_ir(lambda: kernel, types.void(*args))
        print(name, "nv_float_as_int" in ir, "nv_int_as_float" in ir)
"""


def test_gather_kernels_lower_for_the_device():
    lines = dict(line.split(" ", 1) for line in run_lowering(SCRIPT).splitlines())
    expected = {name: "False False" for name in
                ("copy_u2", "copy_u8", "gather_u4", "scatter_float16", "scatter_float32",
                 "scatter_float64")}
    expected["scatter_int16"] = "True True"  # bfloat16 bits: read up and rounded down
    assert lines == expected, lines
