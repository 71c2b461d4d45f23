"""A user function that can raise is refused before a CUDA launch (:mod:`sdpa_numba.gpu.raising`).

numba-cuda ends a thread whose device code raises silently (no debug build): the output was
garbage and no error reached the user. Here, without a GPU, the real kernels are lowered to
LLVM IR (in a subprocess without the simulator, :mod:`device_lowering`): with a raising
``score_mod`` or ``mask_mod`` the IR shows a raising function, named after the user's; with
total ones, or none, the library's own code shows none (so nothing is refused wrongly).
"""

import pytest

from device_lowering import run_lowering

pytest.importorskip("numba.cuda")

SCRIPT = """
    import importlib
    import numba
    import numpy as np
    fw = importlib.import_module("sdpa_numba.gpu.forward")
    bw = importlib.import_module("sdpa_numba.gpu.backward")
    from sdpa_numba.gpu.options import Blocks
    from sdpa_numba.gpu.raising import raising_functions
    from sdpa_numba.gpu.variants import compile_key
    from sdpa_numba.score.recipe import DENSE

    @numba.njit
    def raising_mod(s, b, h, i, j):
        if j > 1000:
            raise ValueError("too far")
        return s

    @numba.njit
    def total_mod(s, b, h, i, j):
        return s * 0.5

    @numba.njit
    def raising_keep(b, h, i, j):
        if i < 0:
            raise IndexError("negative row")
        return j <= i

    blocks = Blocks(32, 16, 128, 4)
    st = np.dtype(np.float32)
    cases = {
        "dense": DENSE,
        "raising_score_mod": DENSE._replace(score_mod=raising_mod),
        "total_score_mod": DENSE._replace(score_mod=total_mod),
        "raising_mask_mod": DENSE._replace(mask_mod=raising_keep),
    }
    for name, r in cases.items():
        parts = compile_key(r)
        made = [(lambda: fw._make_kernel(st, "none", blocks, blocks.out_cols(64), parts),
                 fw._signature(st, "none", parts)[0])]
        if name != "raising_mask_mod":
            made.append((lambda: bw._make_dkv_kernel(st, "none", blocks, parts),
                         bw.dkv_signature(st, "none", parts)[0]))
        for make, sig in made:
            found = raising_functions(lowered_ir(make, sig))
            print(name, " ".join(sorted({u for u in ("raising_mod", "total_mod",
                  "raising_keep") for f in found if u in f})) or "-")
"""


def test_raising_user_functions_show_in_the_kernels_ir():
    lines = run_lowering(SCRIPT).splitlines()
    assert lines == ["dense -", "dense -", "raising_score_mod raising_mod",
                     "raising_score_mod raising_mod", "total_score_mod -",
                     "total_score_mod -", "raising_mask_mod raising_keep"], lines


def test_refused_before_launch_with_the_functions_name(monkeypatch):
    import sdpa_numba.gpu.arrays
    from sdpa_numba.gpu.raising import refuse_raising

    # as on a GPU: a process that ran the simulator tests before (one pytest worker runs
    # tests/cuda too) has NUMBA_ENABLE_CUDASIM set, and the simulator needs no refusal
    monkeypatch.setattr(sdpa_numba.gpu.arrays, "is_simulated_mode", lambda: False)

    ir = ('define i32 @"_ZN8__main__3fooE"(i8** %".ret") {\n  ret i32 1\n}\n'
          'define void @"kernel"() {\n  %".1" = call i32 @"_ZN8__main__3fooE"(i8** null)\n'
          '  ret void\n}\n')

    class Kernel:  # a compiled kernel as numba-cuda shows it
        def inspect_llvm(self, sig=None):
            return {("sig",): ir}

    def foo(s, b, h, i, j):
        return s

    with pytest.raises(ValueError, match="foo can raise an exception"):
        refuse_raising(Kernel(), (foo, None, None))
    ir = ir.replace("ret i32 1", "ret i32 0")
    refuse_raising(Kernel(), (foo, None, None))  # a new kernel: checked afresh, accepted
