"""Attention variants on the CPU (the score seam): the soft cap and a causal sliding window,
time and GFLOP/s of the work they visit.

Both are run-time numbers of the same compiled kernel as plain attention, so this suite adds no
compilation. ``track_gflops`` counts the dense FLOPs for the soft cap (every score is computed)
and, for the window, the FLOPs of the (query, key) pairs inside it.

Commits older than the variants have no ``softcap``/``window`` keywords: setup raises
NotImplementedError there, which asv records as skipped.
"""

import inspect

import sdpa_numba

from .common import flops, inputs, min_time


def _has_variants():
    return "window" in inspect.signature(sdpa_numba.scaled_dot_product_attention).parameters


class Variants:
    """B1 H8 D64 float32: the soft cap (30, Gemma 2's) and a causal window of 256 keys."""

    params = ([512, 2048], ["softcap", "window256"])
    param_names = ["L", "variant"]
    number = 1
    repeat = (1, 10, 20.0)
    warmup_time = 0.0

    def setup(self, L, variant):
        if not _has_variants():
            raise NotImplementedError("this commit has no attention variants")
        self.q, self.k, self.v = inputs(1, 8, L, 64, "float32")
        if variant == "softcap":
            self.kw = {"softcap": 30.0}
            self.flop = flops(1, 8, L, L, 64, False)
        else:
            self.kw = {"is_causal": True, "window": (255, 0)}
            pairs = sum(min(i + 1, 256) for i in range(L))
            self.flop = 4 * 8 * pairs * 64
        self._call()  # compile or load, warm up

    def _call(self):
        sdpa_numba.scaled_dot_product_attention(self.q, self.k, self.v, **self.kw)

    def time_forward(self, L, variant):
        self._call()

    def track_gflops(self, L, variant):
        return self.flop / min_time(self._call, 3) / 1e9

    track_gflops.unit = "GFLOP/s"
