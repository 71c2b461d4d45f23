"""The score recipe's optional arrays reach the real CUDA kernels (:mod:`sdpa_numba.gpu.variants`
makes the kernel argument and the in-kernel recipe from the recipe's fields): the forward
kernel, lowered to LLVM IR without a GPU (:mod:`device_lowering`), with ALiBi slopes, sinks
and an array in ``mod_args`` present, reads each of them."""

import pytest

from device_lowering import run_lowering

pytest.importorskip("numba.cuda")

SCRIPT = """
    import importlib
    import numba
    import numpy as np
    fw = importlib.import_module("sdpa_numba.gpu.forward")
    from sdpa_numba.gpu.options import Blocks
    from sdpa_numba.gpu.variants import compile_key, arg_type
    from sdpa_numba.score.recipe import DENSE

    @numba.njit
    def biased(s, b, h, i, j, table):
        return s + table[h]

    blocks = Blocks(32, 16, 128, 4)
    st = np.dtype(np.float32)
    ct = np.float32
    r = DENSE._replace(alibi=np.ones((1, 3), ct), sinks=np.zeros(3, ct), score_mod=biased,
                       mod_args=(np.ones(3, ct),))
    parts = compile_key(r)
    print("arrays", " ".join(name for name, _, _ in parts.arrays))
    print("fields", " ".join(arg_type(parts).fields))
    ir = lowered_ir(lambda: fw._make_kernel(st, "none", blocks, blocks.out_cols(64), parts),
                    fw._signature(st, "none", parts)[0])
    print("biased", "biased" in ir)
"""


def test_recipe_arrays_reach_the_cuda_forward():
    lines = run_lowering(SCRIPT).splitlines()
    assert lines[0] == "arrays alibi sinks", lines
    assert lines[1].split()[1:] == ["offset", "left", "right", "chunk", "softcap",
                                    "batch_offset", "alibi", "sinks", "block_mask", "bq", "bk",
                                    "mod_args"], lines
    assert lines[2] == "biased True", lines
