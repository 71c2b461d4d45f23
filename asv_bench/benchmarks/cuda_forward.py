"""Attention on a CUDA GPU through the public API (device arrays in, device arrays out): the
forward and the backward.

Skipped (setup raises NotImplementedError, which asv reports as n/a) where numba.cuda cannot
be imported, no GPU is present, or the commit has no CUDA path yet.

The reasons that can be found without touching the CUDA driver are found once, at import:
asv forks every benchmark from the process that imported this module, and a CUDA context must
not be created before a fork. ``numba.cuda.is_available()`` runs in the forked child.
"""

import ctypes.util
import importlib.util
import os

from .common import flops, inputs, min_time


#: The GPU subpackage's name: sdpa_numba.gpu, sdpa_numba.cuda in commits before the rename.
GPU_PACKAGES = ("sdpa_numba.gpu", "sdpa_numba.cuda")


def _cheap_skip_reason():
    """Why CUDA benchmarks cannot run, from facts that need no driver call; None if they may."""
    if os.environ.get("NUMBA_ENABLE_CUDASIM") == "1":
        return "NUMBA_ENABLE_CUDASIM=1: numba.cuda is the simulator, not a GPU"
    found = False
    for name in GPU_PACKAGES:
        try:
            found = found or importlib.util.find_spec(name) is not None
        except (ImportError, ValueError, RecursionError):
            # numba-cuda 0.30's import redirector recurses on any name containing
            # "numba.cuda" (the old name) unless that commit installs its own finder.
            pass
    if not found:
        return "this commit has no CUDA path (sdpa_numba.gpu, earlier sdpa_numba.cuda)"
    if not os.path.exists("/dev/nvidiactl") and ctypes.util.find_library("cuda") is None:
        return "no CUDA driver on this machine (no /dev/nvidiactl, no libcuda)"
    return None


SKIP_REASON = _cheap_skip_reason()


def cuda_or_skip():
    """``numba.cuda`` when a GPU and ``sdpa_numba.gpu`` are there; NotImplementedError if not."""
    if SKIP_REASON:
        raise NotImplementedError(SKIP_REASON)
    try:
        from numba import cuda
    except Exception as exc:
        raise NotImplementedError(f"numba.cuda cannot be imported: {exc}") from None
    try:
        available = cuda.is_available()
    except Exception as exc:
        raise NotImplementedError(f"no usable CUDA GPU: {exc}") from None
    if not available:
        raise NotImplementedError("no CUDA GPU on this machine")
    import sdpa_numba  # noqa: F401  (older commits install their import finder here)

    for name in GPU_PACKAGES:
        try:
            importlib.import_module(name)
            break
        except ImportError as exc:
            error = exc
    else:
        raise NotImplementedError(f"this commit has no CUDA path: {error}") from None
    return cuda


class CudaForward:
    """B2 H16 self-attention on the GPU over L, head dim, causality and dtype."""

    params = ([1024, 4096, 16384], [64, 128], [False, True], ["float16", "float32"])
    param_names = ["L", "head_dim", "causal", "dtype"]
    number = 1
    repeat = (3, 20, 20.0)
    warmup_time = 0.0

    def setup(self, L, e, causal, dtype):
        cuda = cuda_or_skip()
        from sdpa_numba import scaled_dot_product_attention as sdpa

        self.cuda, self.sdpa = cuda, sdpa
        self.shape, self.causal = (2, 16, L, e), causal
        self.q, self.k, self.v = (cuda.to_device(x) for x in inputs(2, 16, L, e, dtype))
        try:
            self._call()  # compile or load, warm up
        except ImportError as exc:
            raise NotImplementedError(f"the CUDA path cannot run at this commit: {exc}") from None

    def _call(self):
        self.sdpa(self.q, self.k, self.v, is_causal=self.causal)
        self.cuda.synchronize()

    def time_forward(self, L, e, causal, dtype):
        self._call()

    def track_gflops(self, L, e, causal, dtype):
        b, h, L, e = self.shape
        return flops(b, h, L, L, e, self.causal) / min_time(self._call, 5) / 1e9

    track_gflops.unit = "GFLOP/s"


class CudaBackward:
    """B2 H16 D64 gradients on the GPU over L and causality (float16, float32); FLOPs
    8·B·H·L·S·E, half when causal, as for the CPU backward. Skipped like :class:`CudaForward`,
    and on commits whose backward has no CUDA path."""

    params = ([1024, 4096], [False, True], ["float16", "float32"])
    param_names = ["L", "causal", "dtype"]
    number = 1
    repeat = (3, 20, 20.0)
    warmup_time = 0.0

    def setup(self, L, causal, dtype):
        cuda = cuda_or_skip()
        import sdpa_numba

        backward = getattr(sdpa_numba, "scaled_dot_product_attention_backward", None)
        if backward is None:
            raise NotImplementedError("this commit has no backward")
        self.cuda, self.backward = cuda, backward
        self.shape, self.causal = (2, 16, L, 64), causal
        host = inputs(2, 16, L, 64, dtype) + inputs(2, 16, L, 64, dtype, seed=1)[:1]
        self.q, self.k, self.v, self.grad_out = (cuda.to_device(x) for x in host)
        try:
            self.out, self.lse = sdpa_numba.scaled_dot_product_attention(
                self.q, self.k, self.v, is_causal=causal, return_lse=True)
            self._call()  # compile or load, warm up
        except NotImplementedError as exc:
            raise NotImplementedError(f"no CUDA backward at this commit: {exc}") from None

    def _call(self):
        self.backward(self.grad_out, self.q, self.k, self.v, self.out, self.lse,
                      is_causal=self.causal)
        self.cuda.synchronize()

    def time_backward(self, L, causal, dtype):
        self._call()

    def track_gflops(self, L, causal, dtype):
        b, h, L, e = self.shape
        return flops(b, h, L, L, e, self.causal, backward=True) / min_time(self._call, 5) / 1e9

    track_gflops.unit = "GFLOP/s"
