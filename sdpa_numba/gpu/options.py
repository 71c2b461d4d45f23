"""Compilation options and block sizes of the CUDA kernels.

``FASTMATH`` is the target-neutral one of :mod:`sdpa_numba.options` (see there why
``nnan``/``ninf`` are never set).

Block sizes are chosen by the launcher from the device's limits (shared memory and threads per
block); :data:`BLOCKS` overrides that choice for every launch, e.g. with tiny blocks so that
tests on tiny inputs still cross several query and key blocks.
"""

from dataclasses import dataclass

from ..options import FASTMATH

__all__ = ["FASTMATH", "Blocks", "CANDIDATES", "BLOCKS"]


@dataclass(frozen=True)
class Blocks:
    """How the forward kernel tiles the work.

    Parameters
    ----------
    block_m : int
        Query rows per thread block.
    block_n : int
        Keys per key/value block staged through shared memory.
    threads : int
        Threads per thread block.
    rows_per_thread : int
        Query rows of the score and output tiles that each thread owns.

    Notes
    -----
    The threads form ``block_m // rows_per_thread`` row groups of ``threads_per_row`` threads;
    each thread computes ``rows_per_thread x (block_n // threads_per_row)`` scores and
    ``rows_per_thread x ceil(Ev / threads_per_row)`` output values. So ``rows_per_thread``
    must divide ``block_m``, the row groups must divide ``threads``, and ``threads_per_row``
    must divide ``block_n``.
    """

    block_m: int
    block_n: int
    threads: int
    rows_per_thread: int

    def __post_init__(self):
        for name in ("block_m", "block_n", "threads", "rows_per_thread"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"Blocks.{name} must be a positive int, got {value!r}")
        if (self.block_m % self.rows_per_thread or self.threads % self.row_groups
                or self.block_n % self.threads_per_row):
            raise ValueError(
                f"inconsistent {self}: rows_per_thread must divide block_m, "
                f"block_m // rows_per_thread must divide threads, and "
                f"threads // (block_m // rows_per_thread) must divide block_n")

    @property
    def row_groups(self):
        return self.block_m // self.rows_per_thread

    @property
    def threads_per_row(self):
        return self.threads // self.row_groups

    def out_cols(self, ev):
        """Output columns per thread for a value head dim ``ev`` (at least 1)."""
        return max(1, -(-ev // self.threads_per_row))

    def shared_elements(self, e, ev):
        """Elements of the compute dtype in shared memory for head dims ``e`` and ``ev``.

        Q tile (padded rows), Kᵀ tile (padded rows), V tile (``out_cols`` per thread column),
        scores tile (padded rows), and the running max, sum and rescaling factor of each row.
        """
        bm, bn = self.block_m, self.block_n
        return (bm * (e | 1) + e * (bn + 1) + bn * self.out_cols(ev) * self.threads_per_row
                + bm * (bn + 1) + 3 * bm)


#: Largest first: the launcher takes the first that fits the device's limits.
CANDIDATES = (
    Blocks(64, 64, 256, 4),
    Blocks(64, 32, 256, 4),
    Blocks(32, 32, 128, 4),
    Blocks(32, 16, 128, 4),
    Blocks(16, 16, 64, 4),
    Blocks(16, 8, 32, 4),
    Blocks(8, 8, 32, 2),
    Blocks(4, 4, 16, 1),
    Blocks(1, 1, 1, 1),
)

#: When not None, the :class:`Blocks` every launch uses (tests set tiny ones).
BLOCKS = None
