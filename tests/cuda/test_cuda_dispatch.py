"""Dispatch to the CUDA path: kinds of arrays, imports, and no side effects on the CPU path."""

import os
import subprocess
import sys

import numpy as np
import pytest
from numba import njit, prange

import sdpa_numba
from sdpa_numba import reference
from sdpa_cuda_testing import REAL_GPU, SIMULATED, dev, rel_err, torch_cuda

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _python(code, **env):
    """Run ``code`` in a fresh interpreter on this source tree; returns its stdout."""
    full_env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    full_env.update(env)
    done = subprocess.run([sys.executable, "-c", code], env=full_env, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_importing_sdpa_numba_does_not_import_numba_cuda():
    out = _python("import sys, sdpa_numba, sdpa_numba.cpu.launch\n"
                  "print(sorted(m for m in sys.modules if m.startswith(('numba.cuda', "
                  "'numba_cuda', 'sdpa_numba.gpu'))))")
    assert out.strip() == "[]"


def test_running_on_the_host_does_not_import_numba_cuda():
    """The host target's launchers come through sdpa_numba.targets without the CUDA one's."""
    out = _python("import sys, numpy as np, sdpa_numba\n"
                  "q = np.ones((1, 2, 3, 4)); o, l = sdpa_numba.scaled_dot_product_attention("
                  "q, q, q, return_lse=True)\n"
                  "sdpa_numba.merge_attention_states(o, l, o, l)\n"
                  "sdpa_numba.merge_attention_states([o, o], [l, l])\n"
                  "print(sorted(m for m in sys.modules if m.startswith(('numba.cuda', "
                  "'numba_cuda', 'sdpa_numba.gpu'))))")
    assert out.strip() == "[]"


def test_sdpa_numba_gpu_imports_in_a_fresh_process():
    """numba-cuda installs a process-wide import redirector for every module name that
    contains "numba.cuda"; the GPU subpackage's name does not, so it imports with no import
    hook of ours on sys.meta_path."""
    out = _python("import sys, sdpa_numba.gpu as g; print(g.forward.__name__); "
                  "print(len([f for f in sys.meta_path "
                  "if type(f).__module__.startswith('sdpa_numba')]))",
                  NUMBA_ENABLE_CUDASIM="1")
    assert out.split() == ["forward", "0"]


@pytest.mark.skipif(not SIMULATED, reason="about the simulator only")
def test_cpu_path_unaffected_by_the_simulator():
    """The simulator is on in this process: Numba's CPU target and the CPU kernels still
    work, in parallel, on host arrays."""

    @njit(parallel=True)
    def total(x):
        s = 0.0
        for i in prange(x.shape[0]):
            s += x[i]
        return s

    assert total(np.arange(1000.0)) == 499500.0
    rng = np.random.default_rng(3)
    shapes = ((2, 9, 4), (2, 7, 4), (2, 7, 3))
    q, k, v = (rng.standard_normal(s).astype(np.float32) for s in shapes)
    out = sdpa_numba.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert isinstance(out, np.ndarray)
    assert rel_err(out, reference.attention(q, k, v, is_causal=True)[0]) <= 1e-5


class _ForeignCudaArray:
    """Stands for a CUDA array of another library (only its interface is looked at)."""

    def __init__(self, dtype, shape=(3, 2)):
        self.dtype = dtype
        self.shape = shape
        self.ndim = len(shape)

    @property
    def __cuda_array_interface__(self):
        return {"shape": self.shape, "typestr": "<V2", "data": (0, False), "version": 3,
                "strides": None}


def test_bfloat16_is_not_implemented():
    x = _ForeignCudaArray("torch.bfloat16")
    with pytest.raises(NotImplementedError, match="bfloat16"):
        sdpa_numba.scaled_dot_product_attention(x, x, x)


@pytest.mark.skipif(not SIMULATED, reason="the simulator's limitation only")
def test_foreign_arrays_on_the_simulator_are_a_type_error():
    x = _ForeignCudaArray("float32")
    with pytest.raises(TypeError, match="simulator"):
        sdpa_numba.scaled_dot_product_attention(x, x, x)


@pytest.mark.skipif(torch_cuda() is None, reason="needs a GPU and torch with CUDA")
def test_torch_in_torch_out():
    torch = torch_cuda()
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(s, device="cuda", generator=g) for s in ((2, 3, 9, 8), (2, 3, 7, 8),
                                                                     (2, 3, 7, 5)))
    q = q.transpose(1, 2).contiguous().transpose(1, 2)  # a strided view, read in place
    out, lse = sdpa_numba.scaled_dot_product_attention(q, k, v, is_causal=True, return_lse=True)
    assert isinstance(out, torch.Tensor) and out.is_cuda and out.dtype == torch.float32
    assert isinstance(lse, torch.Tensor) and lse.shape == (2, 3, 9)
    want, _ = reference.attention(*(x.cpu().numpy() for x in (q, k, v)), is_causal=True)
    assert rel_err(out.cpu().numpy(), want) <= 1e-5
    buf = torch.full_like(out, float("nan"))
    assert sdpa_numba.scaled_dot_product_attention(q, k, v, out=buf) is buf


@pytest.mark.skipif(not REAL_GPU, reason="needs a GPU and CuPy")
def test_cupy_in_cupy_out():
    cupy = pytest.importorskip("cupy")
    rng = np.random.default_rng(5)
    shapes = ((2, 9, 8), (2, 7, 8), (2, 7, 5))
    q, k, v = (rng.standard_normal(s).astype(np.float32) for s in shapes)
    out = sdpa_numba.scaled_dot_product_attention(*map(cupy.asarray, (q, k, v)))
    assert isinstance(out, cupy.ndarray)
    assert rel_err(cupy.asnumpy(out), reference.attention(q, k, v)[0]) <= 1e-5


def test_numba_device_arrays_in_numba_out():
    rng = np.random.default_rng(6)
    q = rng.standard_normal((2, 5, 4)).astype(np.float32)
    dq = dev(q)
    out, lse = sdpa_numba.scaled_dot_product_attention(dq, dq, dq, return_lse=True)
    assert type(out) is type(dq) and type(lse) is type(dq)
    assert rel_err(out.copy_to_host(), reference.attention(q, q, q)[0]) <= 1e-5


def _gpu_check(*args, timeout=300):
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
    return subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "gpu_check.py"), *args],
                          env=env, capture_output=True, text=True, timeout=timeout)


@pytest.mark.skipif(REAL_GPU, reason="on a GPU the script would really run")
def test_gpu_check_without_a_gpu_says_so():
    done = _gpu_check()
    assert done.returncode == 2, done.stderr
    assert "no GPU" in done.stderr and "--simulate" in done.stderr


def test_gpu_check_logic_on_the_simulator():
    # every section, uncached compiles on a shared CPU: about 4 minutes
    done = _gpu_check("--simulate", "--skip-tests", "--runs", "1", timeout=480)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "TFLOP/s" in done.stdout and "float16" in done.stdout
    assert "Backward" in done.stdout and "differ from torch" not in done.stdout
    assert "Cascade:" in done.stdout  # the last section ran (issue 31's table)


def test_gpu_check_only_cascade_on_the_simulator():
    # --only-cascade: the cascade table alone (no tests, no other section), a row per call
    # and dtype, each matching the CPU kernel's result of the same call.
    done = _gpu_check("--simulate", "--only-cascade", "--runs", "1")
    assert done.returncode == 0, done.stdout + done.stderr
    out = done.stdout
    assert "Cascade:" in out and "tests/cuda" not in out
    assert not any(title in out for title in ("Forward", "Variants", "Decode", "Varlen"))
    rows = [line.split("|") for line in out.splitlines()
            if line.startswith(("float16 ", "float32 "))]
    calls = ("cascade", "per-request", "batched, shared pages")
    assert sorted((r[0].split()[0], r[1].strip()) for r in rows) == sorted(
        (dt, c) for dt in ("float16", "float32") for c in calls)
    for r in rows:
        assert float(r[-1]) <= (1e-3 if r[0].startswith("float16") else 1e-6), r
