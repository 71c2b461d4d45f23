"""The compiled specializations of the CPU kernels: which there are, compiling them ahead of
time, and which of them Numba's on-disk cache holds.

Each (dtype, mask kind, dropout on/off) is one compiled forward and each (dtype, mask kind) one
compiled backward (the backward takes "no mask" as an empty bool mask, and dropout as a runtime
argument). Compiling one costs about ten seconds the first time on a machine; Numba's cache
then keeps it, so ``python -m sdpa_numba warmup`` run while a container image is built (or
in a CI cache step) spares users the first-call compile.
"""

from dataclasses import dataclass

import numpy as np

DTYPES = ("float16", "bfloat16", "float32", "float64")
MASKS = ("none", "bool", "additive")


@dataclass(frozen=True)
class Specialization:
    """One compiled kernel: ``kernel`` is "forward" or "backward"."""

    kernel: str
    dtype: str
    mask: str
    dropout: bool = False

    def __str__(self):
        extra = ", dropout" if self.dropout else ""
        return f"{self.kernel} {self.dtype}, mask {self.mask}{extra}"

    def _dispatcher_and_signature(self):
        # bfloat16 by name: compiling it needs no ml_dtypes
        dt = self.dtype if self.dtype == "bfloat16" else np.dtype(self.dtype)
        if self.kernel == "forward":
            from .forward import forward
            from .launch import signature

            return forward, signature(dt, self.mask, self.dropout)
        from .backward import backward
        from .launch_backward import signature

        return backward, signature(dt, "additive" if self.mask == "additive" else "bool")

    def compile(self):
        """Compile (or load from Numba's cache) this specialization, as a first call would."""
        dt = np.dtype(self.dtype)
        if self.kernel == "forward":
            from .launch import _entry

            _entry(dt, self.mask, self.dropout)
        else:
            from .launch_backward import _entry

            _entry(dt, "additive" if self.mask == "additive" else "bool")

    def is_cached(self):
        """Whether Numba's on-disk cache holds this specialization for this machine, numba
        version and source (None when that cannot be told)."""
        disp, sig = self._dispatcher_and_signature()
        try:
            cache = disp._cache
            index = cache._cache_file._load_index()
            return cache._index_key(sig, disp.targetctx.codegen()) in index
        except Exception:  # Numba's cache internals are not public: say "unknown"
            return None


def specializations(dtypes=DTYPES, masks=MASKS, dropout=(False, True), backward=True):
    """The specializations for these choices, forward first; the backward's "none" and
    "bool" masks are one specialization, listed once."""
    out = []
    for dt in dtypes:
        for mask in masks:
            out += [Specialization("forward", dt, mask, d) for d in dropout]
        if backward:
            kinds = dict.fromkeys("additive" if m == "additive" else "bool" for m in masks)
            out += [Specialization("backward", dt, m) for m in kinds]
    return out
