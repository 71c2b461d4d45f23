"""Backward attention on the CPU (FlashAttention-2's backward): time and GFLOP/s.

The forward (with ``return_lse=True``) runs in ``setup``, which also compiles or loads the
backward kernels and warms them up; only the backward is timed. ``track_gflops`` counts
8·B·H·L·S·E FLOPs (the four L x S x E products dV, dP, dQ, dK; recomputing S is not counted),
half when causal — the convention of tests/benchmarks/test_bench_backward.py.

Commits older than the backward have no ``scaled_dot_product_attention_backward``: setup raises
NotImplementedError there, which asv records as skipped.
"""

import sdpa_numba

from .common import flops, inputs, min_time


class Backward:
    """B1 H8 D64 float32 self-attention gradients over L and causality."""

    params = ([512, 1024, 2048], [False, True])
    param_names = ["L", "causal"]
    number = 1
    repeat = (1, 10, 20.0)
    warmup_time = 0.0

    def setup(self, L, causal):
        backward = getattr(sdpa_numba, "scaled_dot_product_attention_backward", None)
        if backward is None:
            raise NotImplementedError("this commit has no backward")
        self.shape, self.causal = (1, 8, L, 64), causal
        self.q, self.k, self.v = inputs(1, 8, L, 64, "float32")
        self.grad_out = inputs(1, 8, L, 64, "float32", seed=1)[0]
        self.out, self.lse = sdpa_numba.scaled_dot_product_attention(
            self.q, self.k, self.v, is_causal=causal, return_lse=True)
        self._backward = backward
        self._call()  # compile or load, warm up

    def _call(self):
        self._backward(self.grad_out, self.q, self.k, self.v, self.out, self.lse,
                       is_causal=self.causal)

    def time_backward(self, L, causal):
        self._call()

    def track_gflops(self, L, causal):
        b, h, L, e = self.shape
        return flops(b, h, L, L, e, causal, backward=True) / min_time(self._call, 3) / 1e9

    track_gflops.unit = "GFLOP/s"
