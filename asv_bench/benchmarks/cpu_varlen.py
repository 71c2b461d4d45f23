"""Varlen on the CPU (``varlen_attention`` and its backward): a ragged batch of 8 causal
sequences packed back to back, H8 D64 float32, lengths from ``bench.varlen.lengths`` (100 to
2000 tokens) scaled to the longest ``L`` (the ``bench --preset varlen`` batch at L = 2000).

Commits older than the varlen API have no ``varlen_attention``: setup raises
NotImplementedError there, which asv records as skipped.
"""

import numpy as np

import sdpa_numba

from .common import flops, min_time

#: The preset's lengths (sdpa_numba.bench.varlen.lengths()), fixed here so that every commit
#: times the same batch.
LENGTHS = np.array([100, 2000, 1666, 1557, 1177, 1123, 918, 278])


class Varlen:
    """Forward and backward; GFLOP/s is the sum of each sequence's causal count
    (:func:`.common.flops`)."""

    params = ([500, 2000], ["forward", "backward"])
    param_names = ["L", "direction"]
    number = 1
    repeat = (1, 10, 20.0)
    warmup_time = 0.0

    def setup(self, L, direction):
        fwd = getattr(sdpa_numba, "varlen_attention", None)
        if fwd is None:
            raise NotImplementedError("this commit has no varlen_attention")
        lens = np.maximum(LENGTHS * L // 2000, 1)
        cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
        rng = np.random.default_rng(0)
        q, k, v, g = (rng.standard_normal((int(cu[-1]), 8, 64), dtype=np.float32)
                      for _ in range(4))
        out, lse = fwd(q, k, v, cu, cu, is_causal=True, return_lse=True)
        backward = direction == "backward"
        self.flops = sum(flops(1, 8, int(n), int(n), 64, True, backward=backward)
                         for n in lens)
        if backward:
            bwd = sdpa_numba.varlen_attention_backward
            self._call = lambda: bwd(g, q, k, v, out, lse, cu, cu, is_causal=True)
        else:
            self._call = lambda: fwd(q, k, v, cu, cu, is_causal=True)
        self._call()  # compile or load, warm up

    def time_varlen(self, L, direction):
        self._call()

    def track_gflops(self, L, direction):
        return self.flops / min_time(self._call, 5) / 1e9

    track_gflops.unit = "GFLOP/s"
