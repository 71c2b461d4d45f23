"""Compiling the CPU kernels ahead of time: :func:`warmup` compiles chosen specializations
(one per dtype, mask kind and dropout on/off for the forward; per dtype and mask kind for the
backward) into Numba's on-disk cache, so that later processes load them in about a second
instead of compiling (~10 s each); :func:`cached_kernels` says which the cache holds;
``DTYPES`` and ``MASKS`` are the choices. ``python -m sdpa_numba warmup`` and ``info`` call
these. The CPU kernels are imported on first use, not with ``sdpa_numba``."""

import time

__all__ = ["warmup", "cached_kernels", "DTYPES", "MASKS"]


def __getattr__(name):
    # DTYPES and MASKS, without importing the kernels with the package
    if name in ("DTYPES", "MASKS"):
        from .cpu import specializations

        return getattr(specializations, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def warmup(dtypes=("float32",), masks=None, dropout=(False,), backward=True, progress=None):
    """Compile (or load from Numba's cache) the CPU kernels for these choices.

    Parameters
    ----------
    dtypes : sequence of str
        Storage dtypes, from :data:`DTYPES` (default float32).
    masks : sequence of str
        Mask kinds, from :data:`MASKS`: "none", "bool", "additive" (None: all three).
    dropout : sequence of bool
        Forward kernels without dropout (False), with it (True), or both.
    backward : bool
        Also the backward kernels.
    progress : callable, optional
        Called with each record below as soon as its kernel is ready.

    Returns
    -------
    list of dict
        One record per specialization: ``name``, ``kernel`` ("forward" or "backward"),
        ``dtype``, ``mask``, ``dropout``, ``seconds`` (compiling or loading it),
        ``was_cached`` and ``cached`` (whether Numba's cache held it before and holds it
        after; None when that cannot be told).
    """
    from .cpu.specializations import MASKS, specializations

    done = []
    masks = MASKS if masks is None else masks
    for spec in specializations(dtypes, masks, dropout, backward=backward):
        was_cached = spec.is_cached()
        t0 = time.perf_counter()
        spec.compile()
        seconds = time.perf_counter() - t0
        record = {"name": str(spec), "kernel": spec.kernel, "dtype": spec.dtype,
                  "mask": spec.mask, "dropout": spec.dropout, "seconds": seconds,
                  "was_cached": was_cached, "cached": spec.is_cached()}
        done.append(record)
        if progress is not None:
            progress(record)
    return done


def cached_kernels():
    """The names of the CPU kernel specializations Numba's on-disk cache holds (for this
    machine, Numba version and source), e.g. ``"forward float32, mask none"``."""
    from .cpu.specializations import specializations

    return [str(s) for s in specializations() if s.is_cached()]
