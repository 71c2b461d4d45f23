"""A user's ``@cuda.jit`` kernel with the variants types and lowers for the real CUDA target,
on a machine without a GPU, CUDA driver or CUDA compiler.

The simulator runs ``recipe`` and :func:`sdpa_numba.gpu.attend_row_recipe` as Python; on the
device, their ``@overload``s and the user's ``@njit`` functions are compiled as device code,
which no simulator test reaches. Here such a kernel goes through Numba's CUDA front end and
lowering to LLVM IR (stopping before NVVM), in a subprocess without the simulator.
"""

import pytest

from device_lowering import run_lowering

pytest.importorskip("numba.cuda")

SCRIPT = """
    import math
    import numba
    from sdpa_numba.gpu import attend_row_recipe, online_softmax_finalize
    from sdpa_numba.gpu.options import FASTMATH
    from sdpa_numba.score.recipe import recipe

    @numba.njit
    def rel_bias(s, b, h, i, j, table, doc):
        return s + table[h, i - j + table.shape[1] // 2]

    @numba.njit
    def same_doc(b, h, i, j, table, doc):
        return doc[i] == doc[j]

    def user(q, k, v, scale, table, doc, out, lse):
        h, i = cuda.grid(2)
        if h >= q.shape[0] or i >= q.shape[1]:
            return
        S = k.shape[1]
        r = recipe(offset=S - q.shape[1], left=6, right=0, softcap=2.5, score_mod=rel_bias,
                   mask_mod=same_doc, mod_args=(table, doc))
        s = cuda.local.array(16, numba.float32)
        acc = cuda.local.array(64, numba.float32)
        for d in range(v.shape[2]):
            acc[d] = 0
        m = numba.float32(-math.inf)
        l = numba.float32(0)
        for j0 in range(0, S, 16):
            j1 = min(S, j0 + 16)
            m, l = attend_row_recipe(q[h, i], k[h, j0:j1], v[h, j0:j1], scale, s, m, l, acc,
                                     r, 0, h, i, j0)
        lse[h, i] = online_softmax_finalize(m, l, acc, out[h, i])

    f32 = types.float32
    a3, a2 = types.Array(f32, 3, "A"), types.Array(f32, 2, "A")
    sig = (a3, a3, a3, f32, a2, types.Array(types.int64, 1, "A"), a3, a2)
    cres = compiler.compile_cuda(user, types.void, sig, cc=(9, 0), fastmath=FASTMATH)
    ir = cres.library.get_llvm_str()
    print("tanh" in ir, "rel_bias" in ir, "same_doc" in ir)
"""


def test_user_kernel_with_a_recipe_lowers_for_the_device():
    out = run_lowering(SCRIPT)
    # the soft cap's tanh and the user's two functions are compiled into the kernel
    assert out.split() == ["True", "True", "True"], out
