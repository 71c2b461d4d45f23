"""The machine a benchmark ran on: versions, threads, the CPU's features, CUDA, the load."""

import importlib.metadata
import os
import platform

import numpy as np


def _version(dist):
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def host_cpu():
    """CPU name and the features LLVM (hence Numba) compiles for, honouring Numba's overrides.

    ``NUMBA_CPU_NAME`` / ``NUMBA_CPU_FEATURES`` replace the host's values when set.
    """
    import llvmlite.binding as llvm
    from numba.core import config

    name = config.CPU_NAME or llvm.get_host_cpu_name()
    if config.CPU_FEATURES is not None:
        enabled = [f[1:] for f in config.CPU_FEATURES.split(",") if f.startswith("+")]
    else:
        enabled = [f for f, on in llvm.get_host_cpu_features().items() if on]
    return {"name": name, "features": sorted(enabled),
            "overridden": config.CPU_NAME is not None or config.CPU_FEATURES is not None}


def cuda_status():
    """``(usable, why)``: whether numba.cuda sees a GPU; never raises."""
    if os.environ.get("NUMBA_ENABLE_CUDASIM") == "1":
        return False, "NUMBA_ENABLE_CUDASIM=1: numba.cuda is the simulator (Python), no GPU"
    try:
        from numba import cuda
    except Exception as exc:  # numba-cuda absent or broken
        return False, f"numba.cuda cannot be imported ({type(exc).__name__}: {exc})"
    try:
        ok = bool(cuda.is_available())
    except Exception as exc:
        return False, f"numba.cuda.is_available() failed ({type(exc).__name__}: {exc})"
    if not ok:
        return False, "no CUDA GPU or driver found"
    try:
        dev = cuda.get_current_device()
        name = dev.name.decode() if isinstance(dev.name, bytes) else str(dev.name)
        return True, f"{name}, compute capability {dev.compute_capability}"
    except Exception as exc:
        return True, f"available ({type(exc).__name__} while naming the device: {exc})"


def _parallel_probe(n):
    """A trivial parallel loop: running it makes Numba choose its threading layer."""
    import numba

    @numba.njit(parallel=True)
    def probe(n):
        total = 0
        for i in numba.prange(n):
            total += i
        return total

    return probe(n)


def threading_layer():
    """Numba's threading layer actually in use (runs a tiny parallel function to pick it)."""
    import numba

    try:
        return numba.threading_layer()
    except ValueError:  # nothing parallel has run yet
        pass
    _parallel_probe(4)
    return numba.threading_layer()


def load_average():
    """The 1-minute load average (None where the OS has none)."""
    return os.getloadavg()[0] if hasattr(os, "getloadavg") else None


def collect_info():
    """Versions, threads, CPU load, CPU features and CUDA availability, as a JSON-able dict.

    The 1-minute load average is there because timings on a machine that other processes keep
    busy are not worth much.
    """
    import numba

    from .. import __version__

    cpu = host_cpu()
    feats = set(cpu["features"])
    usable, why = cuda_status()
    info = {
        "versions": {
            "sdpa_numba": __version__,
            "python": platform.python_version(),
            "numba": numba.__version__,
            "llvmlite": _version("llvmlite"),
            "numpy": np.__version__,
            "torch": _version("torch"),
            "numba-cuda": _version("numba-cuda"),
        },
        "threads": numba.get_num_threads(),
        "load_average_1min": load_average(),
        "threading_layer": threading_layer(),
        "platform": platform.platform(),
        "cpu": {"name": cpu["name"], "from_numba_env_override": cpu["overridden"],
                "avx2": "avx2" in feats, "fma": "fma" in feats, "avx512f": "avx512f" in feats,
                "avx512_extensions": sorted(f for f in feats if f.startswith("avx512")),
                "features": cpu["features"]},
        "cuda": {"usable": usable, "detail": why},
    }
    return info
