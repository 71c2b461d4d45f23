"""Dropout of the attention probabilities without a stored mask: a counter-based random stream.

Whether probability ``P[b, h, i, j]`` is kept is a pure function of
``(seed, b, h, i, j)`` (``b``: flat index into the broadcast batch dims, row-major; ``h``: query
head; ``i``: query row; ``j``: key column), so the backward regenerates exactly the mask that
the forward drew, and any back end (CPU, CUDA) draws the same mask for the same seed. The
function is built from SplitMix64 (Steele, Lea & Flood 2014; the finalizer constants are
Stafford's "Mix13"), using only 64-bit unsigned integer adds, multiplies, shifts and xors,
wrapping modulo 2**64::

    GAMMA = 0x9E3779B97F4A7C15
    mix(z)     = z ^= z >> 30; z *= 0xBF58476D1CE4E5B9; z ^= z >> 27; z *= 0x94D049BB133111EB;
                 z ^ (z >> 31)
    step(k, n) = mix(k + (n + 1) * GAMMA)
    head_key   = step(step(seed, b), h)
    row_key    = step(head_key, i)
    bits       = step(row_key, j)
    kept       = (bits >> 32) >= threshold,       threshold = floor(p * 2**32)

so a probability is kept with probability ``1 - threshold / 2**32`` (``1 - p`` to within
2**-32). As in torch, kept probabilities are scaled by ``1 / (1 - p)`` and the log-sum-exp is
that of the softmax before dropout.

This module holds the Python side (seeds and their check, thresholds, a NumPy implementation
of the mask for references and tests; the problem layer re-exports :func:`check_seed` with the
other argument checks, as :func:`sdpa_numba.problem.check_seed`); the jitted version, for both
targets, is :mod:`sdpa_numba.score.dropout`.
"""

import numbers
import secrets

import numpy as np
import numpy.typing as npt

__all__ = ["GAMMA", "MIX1", "MIX2", "new_seed", "check_seed", "threshold", "params",
           "NO_DROPOUT", "keep_mask"]

GAMMA = 0x9E3779B97F4A7C15
MIX1 = 0xBF58476D1CE4E5B9
MIX2 = 0x94D049BB133111EB

_U64 = 1 << 64


def new_seed() -> int:
    """A fresh 64-bit seed from the operating system's entropy (:mod:`secrets`)."""
    return secrets.randbits(64)


def check_seed(seed: object) -> int | None:
    """``seed`` as a Python int in ``[0, 2**64)``, or None; TypeError / ValueError otherwise."""
    if seed is None:
        return None
    if isinstance(seed, (bool, np.bool_)) or not isinstance(seed, numbers.Integral):
        raise TypeError(f"seed must be an int or None, got {type(seed).__name__}")
    seed = int(seed)
    if not 0 <= seed < _U64:
        raise ValueError(f"seed must be in [0, 2**64), got {seed}")
    return seed


def threshold(p: float) -> int:
    """The integer threshold of drop probability ``p`` in [0, 1): ``floor(p * 2**32)``."""
    return min(int(float(p) * 4294967296.0), 4294967295)


def params(p: float, seed: int,
           batch_offset: int = 0) -> tuple[np.uint64, np.uint64, float, int]:
    """The ``dropout`` argument of the jitted kernels: ``(seed, threshold, 1/(1-p), offset)``.

    Typed ``(uint64, uint64, float64, int64)``. ``batch_offset`` is added to the kernel's batch
    index, so that a launch over part of the batch draws that part's mask. ``p == 0`` gives
    ``inv_keep == 1.0``, which the backward kernel reads as "no dropout".
    """
    p = float(p)
    return (np.uint64(seed), np.uint64(threshold(p)), 1.0 / (1.0 - p), int(batch_offset))



#: The kernels' dropout argument for "no dropout" where they take one at run time (the CPU
#: backward, the CUDA kernels): ``inv_keep == 1.0`` reads as off. Elsewhere no dropout is None.
NO_DROPOUT: tuple[np.uint64, np.uint64, float, int] = params(0.0, 0)

def _mix(z):
    z = (z ^ (z >> np.uint64(30))) * np.uint64(MIX1)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(MIX2)
    return z ^ (z >> np.uint64(31))


def _step(key, n):
    return _mix(key + (np.asarray(n, np.uint64) + np.uint64(1)) * np.uint64(GAMMA))


def keep_mask(seed: int, p: float, batch: tuple[int, ...], heads: int, L: int,
              S: int) -> npt.NDArray[np.bool_]:
    """The keep mask (True = kept) of shape ``(*batch, heads, L, S)``, in NumPy.

    The reference for the kernels (same bits); builds the whole mask, so small sizes only.
    """
    nb = int(np.prod(batch, dtype=np.int64))
    with np.errstate(over="ignore"):
        key = np.asarray(seed, np.uint64)
        b = np.arange(nb, dtype=np.uint64)[:, None, None, None]
        h = np.arange(heads, dtype=np.uint64)[None, :, None, None]
        i = np.arange(L, dtype=np.uint64)[None, None, :, None]
        j = np.arange(S, dtype=np.uint64)[None, None, None, :]
        bits = _step(_step(_step(_step(key, b), h), i), j)
    kept = (bits >> np.uint64(32)) >= np.uint64(threshold(p))
    return kept.reshape((*batch, heads, L, S))
