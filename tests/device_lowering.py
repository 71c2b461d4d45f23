"""Run a script that lowers CUDA kernels for the real target (cc 9.0) on a machine without a
GPU, CUDA driver or CUDA compiler: in a subprocess without the simulator, after
:data:`PREAMBLE` (numba.cuda and its compiler imported, the current device faked;
``uncompiled_jit``: a ``cuda.jit`` to patch in while a kernel factory runs, which keeps the
kernel's Python function instead of compiling it; ``lowered_ir(make, sig)``: the LLVM IR of
the kernel that factory ``make`` builds, compiled for ``sig``'s argument types)."""

import os
import subprocess
import sys
import textwrap

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

PREAMBLE = textwrap.dedent("""
    from numba import cuda, types
    import numba.cuda.dispatcher as dispatcher
    from numba.cuda import compiler

    class _Device:  # device functions ask the current device for its compute capability
        compute_capability = (9, 0)

    dispatcher.get_current_device = lambda: _Device()

    class _Uncompiled:
        def __init__(self, f):
            self.py_func = f

    real_jit = cuda.jit

    def uncompiled_jit(sig=None, **kw):  # the kernel factories compile eagerly: keep py_func
        if kw.get("device"):
            return real_jit(sig, **kw)
        return lambda f: _Uncompiled(f)

    def lowered_ir(make, sig):
        from sdpa_numba.gpu.options import FASTMATH
        cuda.jit = uncompiled_jit
        try:
            kernel = make()
        finally:
            cuda.jit = real_jit
        cres = compiler.compile_cuda(kernel.py_func, types.void, sig.args, cc=(9, 0),
                                     fastmath=FASTMATH)
        return cres.library.get_llvm_str()
""")


def run_lowering(script):
    """The stdout of ``PREAMBLE + script`` run in a fresh interpreter (asserts it exits 0)."""
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run([sys.executable, "-c", PREAMBLE + textwrap.dedent(script)],
                          capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout
