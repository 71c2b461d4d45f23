"""The CPU kernels compiled for a CPU without AVX-512 (16 vector registers), on any x86 machine.

The micro-kernel picks its register tile from the CPU Numba compiles for (see
:mod:`sdpa_numba.cpu.microkernel`). A subprocess compiles the kernels with every AVX-512
feature switched off through ``NUMBA_CPU_FEATURES`` and runs a small forward and backward: the
results must match the float64 reference and, bitwise, this process's results (whatever tile
this machine uses), since the tiles differ only in shape, not in the order of any sum.

The subprocess compiles cold unless ``NUMBA_CACHE_DIR`` holds its code (Numba's cache keys on
the CPU features, so it never loads this process's code). The float32 case always runs (one
forward and one backward specialization, compiled cold: about a minute on 2 cores); the float64
case only with ``SDPA_NUMBA_TEST_NARROW=1``.
"""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

import sdpa_numba
from sdpa_numba import reference

ROOT = Path(__file__).resolve().parents[1]


def _narrow_features():
    """The host's features for LLVM with every 512-bit vector feature off, or None off x86."""
    import llvmlite.binding as ll

    feats = ll.get_host_cpu_features()
    if not feats.get("avx2") or not feats.get("fma"):
        return None
    wide = ("avx512", "avx10", "evex512")
    return ",".join(("-" if k.startswith(wide) or not on else "+") + k
                    for k, on in feats.items())


def _run_narrow(code, timeout):
    import llvmlite.binding as ll

    feats = _narrow_features()
    if feats is None:
        pytest.skip("not an x86 CPU with AVX2 and FMA")
    env = {k: v for k, v in os.environ.items() if not k.startswith("NUMBA_")}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")
    env["NUMBA_CPU_NAME"] = ll.get_host_cpu_name()
    env["NUMBA_CPU_FEATURES"] = feats
    if "NUMBA_CACHE_DIR" in os.environ:
        env["NUMBA_CACHE_DIR"] = os.environ["NUMBA_CACHE_DIR"]
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env,
                          capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    assert proc.returncode == 0, f"rc {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    return proc.stdout


def test_tile_follows_numba_cpu_features():
    out = _run_narrow("""
        from sdpa_numba.cpu import microkernel
        print(microkernel.WIDE_VECTORS)
    """, timeout=120)
    assert out.split() == ["False"]


def _problem(rng, dtype, causal):
    b, h, lq, s, e = 1, 2, 77, 130, 40
    q, k, v, do = (rng.standard_normal(shape).astype(dtype)
                   for shape in [(b, h, lq, e), (b, h, s, e), (b, h, s, e), (b, h, lq, e)])
    return q, k, v, do, causal


_NARROW_RUN = """
    import numpy as np
    import sdpa_numba
    from sdpa_numba.cpu import microkernel
    assert not microkernel.WIDE_VECTORS
    data = np.load({path!r})
    res = {{}}
    for name in {names!r}:
        q, k, v, do = (data[name + x] for x in ("q", "k", "v", "do"))
        causal = bool(data[name + "causal"])
        o, lse = sdpa_numba.scaled_dot_product_attention(q, k, v, is_causal=causal,
                                                         return_lse=True)
        dq, dk, dv = sdpa_numba.scaled_dot_product_attention_backward(
            do, q, k, v, o, lse, is_causal=causal)
        for x, y in zip(("o", "dq", "dk", "dv"), (o, dq, dk, dv)):
            res[name + x] = y
    np.savez({out!r}, **res)
"""


def test_narrow_tile_forward_backward_match_reference_and_wide(rng, tmp_path):
    cases = {"f32": (np.float32, True)}
    if os.environ.get("SDPA_NUMBA_TEST_NARROW") == "1":  # two more cold specializations
        cases["f64"] = (np.float64, False)
    data = {}
    for name, (dtype, causal) in cases.items():
        q, k, v, do, causal = _problem(rng, dtype, causal)
        data.update({name + "q": q, name + "k": k, name + "v": v, name + "do": do,
                     name + "causal": np.array(causal)})
    np.savez(tmp_path / "in.npz", **data)
    code = _NARROW_RUN.format(path=str(tmp_path / "in.npz"), names=list(cases),
                              out=str(tmp_path / "out.npz"))
    _run_narrow(code, timeout=900)
    narrow = np.load(tmp_path / "out.npz")
    for name, (dtype, causal) in cases.items():
        q, k, v, do = (data[name + x] for x in ("q", "k", "v", "do"))
        o, lse = sdpa_numba.scaled_dot_product_attention(q, k, v, is_causal=causal,
                                                         return_lse=True)
        grads = sdpa_numba.scaled_dot_product_attention_backward(do, q, k, v, o, lse,
                                                                 is_causal=causal)
        ref_o, _ = reference.attention(q, k, v, is_causal=causal)
        ref_grads = reference.attention_backward(do, q, k, v, is_causal=causal)
        tol = 1e-5 if dtype == np.float32 else 1e-12
        for x, here, ref in zip(("o", "dq", "dk", "dv"), (o, *grads), (ref_o, *ref_grads)):
            got = narrow[name + x]
            err = np.linalg.norm(got - ref) / np.linalg.norm(ref)
            assert err <= tol, (name, x, err)
            # Same sums in the same order, whatever the register tile.
            assert np.array_equal(got, here), (name, x)
