"""The soft cap's tile passes are compiled on their first use, not with every forward kernel
(sdpa_numba/cpu/lazy.py): a plain call leaves them uncompiled, a soft-capped one compiles
them, through the launcher or through the first-call trampoline from a worker thread of a
user's parallel loop, with the results of the reference.

Each check runs in a fresh process (the cells are per process), on the session's Numba cache.
"""

import os
import subprocess
import sys
import textwrap

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_PRELUDE = """
import importlib
import numpy as np
from numba import types
import sdpa_numba as sn
from sdpa_numba.reference import attention

fw = importlib.import_module("sdpa_numba.cpu.forward")

def compiled(dt):
    return fw._CAPPED.compiled(*fw._capped_signature(dt).args)

rng = np.random.default_rng(33)
# Odd sizes: a partial query tile and a partial key block; scores large enough to be capped.
q, k, v = (rng.standard_normal(s).astype(np.float32) * 3
           for s in ((1, 3, 77, 24), (1, 3, 131, 24), (1, 3, 131, 9)))

def reference(cap, window=None):
    out = np.empty((1, 3, 77, 9))
    for h in range(3):
        out[0, h] = attention(q[0, h].astype(np.float64), k[0, h].astype(np.float64),
                              v[0, h].astype(np.float64), softcap=cap, window=window)[0]
    return out
"""


def _run(body):
    code = _PRELUDE + textwrap.dedent(body)
    res = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                         text=True, timeout=600, env=dict(os.environ, PYTHONPATH=ROOT))
    assert res.returncode == 0, res.stdout + res.stderr
    return res.stdout


def test_plain_call_leaves_soft_cap_uncompiled_and_capped_call_compiles_it():
    out = _run("""
        o = sn.scaled_dot_product_attention(q, k, v)
        assert np.all(np.isfinite(o))
        assert not compiled(types.float32) and not compiled(types.float64)
        for cap, window in ((2.5, None), (1.5, (20, 3))):
            o = np.full((1, 3, 77, 9), np.nan, np.float32)
            sn.scaled_dot_product_attention(q, k, v, softcap=cap, window=window, out=o)
            err = np.abs(o - reference(cap, window)).max()
            assert err < 2e-5, err
        assert compiled(types.float32) and not compiled(types.float64)
        print("ok")
    """)
    assert out.strip() == "ok"


def test_first_use_from_a_users_parallel_loop_compiles_through_the_trampoline():
    # forward_head called from a user's prange loop (no nogil), the recipe made there: the
    # first soft-capped tile of some worker thread enters the trampoline, which compiles the
    # passes; the rows are the dense API's, bitwise.
    out = _run("""
        from numba import njit, prange
        from sdpa_numba import cpu
        from sdpa_numba.score.recipe import recipe

        @njit(parallel=True)
        def heads(q, k, v, out, lse, cap):
            for h in prange(q.shape[0]):
                cpu.forward_head(q[h], k[h], v[h], None, False, 0.25, out[h], lse[h],
                                 recipe(softcap=cap))

        out = np.full((3, 77, 9), np.nan, np.float32)
        lse = np.full((3, 77), np.nan, np.float32)
        assert not compiled(types.float32)
        heads(q[0], k[0], v[0], out, lse, 2.5)
        assert compiled(types.float32)
        want = sn.scaled_dot_product_attention(q, k, v, softcap=2.5, scale=0.25)
        assert np.array_equal(out, want[0]), np.abs(out - want[0]).max()
        print("ok")
    """)
    assert out.strip() == "ok"


def test_lazy_call_is_typed_for_its_signatures_only():
    # The lazy call is typed for its exact signatures only: a wrong argument type is a
    # typing error, not a call through a mismatched pointer.
    from numba import njit, types
    from numba.core.errors import TypingError

    import importlib

    fw = importlib.import_module("sdpa_numba.cpu.forward")

    @njit
    def bad(x):
        fw._call_capped(x, 0, 1, x, x, x, 1.0, 0, 0, 0)  # float64 cap for float32 tiles

    import numpy as np
    from sdpa_numba.cpu._llvm import data_ptr

    @njit
    def call(a):
        bad(data_ptr(a))

    with pytest.raises(TypingError):
        call(np.zeros(4, np.float32))
    assert fw._capped_signature(types.float32).args[6] == types.float32
