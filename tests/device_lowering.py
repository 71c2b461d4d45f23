"""Run a script that lowers CUDA kernels for the real target (cc 9.0) on a machine without a
GPU, CUDA driver or CUDA compiler: in a subprocess without the simulator, after
:data:`PREAMBLE` (numba.cuda and its compiler imported, the current device faked)."""

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
""")


def run_lowering(script):
    """The stdout of ``PREAMBLE + script`` run in a fresh interpreter (asserts it exits 0)."""
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run([sys.executable, "-c", PREAMBLE + textwrap.dedent(script)],
                          capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout
