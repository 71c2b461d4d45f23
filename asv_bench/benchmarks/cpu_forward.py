"""Forward attention on the CPU: time, GFLOP/s and peak memory.

Every benchmark compiles (or loads from Numba's cache) and warms up in ``setup``, never inside
the timed call. Sizes are chosen so that ``asv run --quick`` stays short on 2 cores: B1 H8 up
to L2048, and only :class:`ForwardLong` goes to L8192 (with 4 heads).

``track_gflops`` counts 4·B·H·L·S·E FLOPs (half when causal) over the minimum of a few calls.
"""

from sdpa_numba import scaled_dot_product_attention as sdpa

from .common import flops, inputs, min_time


class _Forward:
    """Shared body: ``self.shape = (B, H, L, E)``, ``self.dtype``, ``self.causal`` set by setup."""

    number = 1  # one call per sample: calls take milliseconds to seconds
    repeat = (1, 10, 20.0)
    warmup_time = 0.0  # setup has warmed up
    gflops_repeats = 3

    def _setup(self, b, h, L, e, dtype, causal):
        self.shape, self.causal = (b, h, L, e), causal
        self.q, self.k, self.v = inputs(b, h, L, e, dtype)
        sdpa(self.q, self.k, self.v, is_causal=causal)  # compile or load, warm up

    def _call(self):
        sdpa(self.q, self.k, self.v, is_causal=self.causal)

    def _gflops(self):
        b, h, L, e = self.shape
        return flops(b, h, L, L, e, self.causal) / min_time(self._call, self.gflops_repeats) / 1e9


class Forward(_Forward):
    """B1 H8 float32 self-attention over L, head dim and causality."""

    params = ([512, 1024, 2048], [64, 128], [False, True])
    param_names = ["L", "head_dim", "causal"]

    def setup(self, L, e, causal):
        self._setup(1, 8, L, e, "float32", causal)

    def time_forward(self, L, e, causal):
        self._call()

    def track_gflops(self, L, e, causal):
        return self._gflops()

    track_gflops.unit = "GFLOP/s"


class ForwardDtype(_Forward):
    """B1 H8 L1024 D64 non-causal in each dtype (float16 computes with float32 accumulators)."""

    params = (["float32", "float16", "float64"],)
    param_names = ["dtype"]

    def setup(self, dtype):
        self._setup(1, 8, 1024, 64, dtype, False)

    def time_forward(self, dtype):
        self._call()

    def track_gflops(self, dtype):
        return self._gflops()

    track_gflops.unit = "GFLOP/s"


class ForwardLong(_Forward):
    """Long sequences, B1 H4 D64 float32: L4096 and L8192."""

    params = ([4096, 8192], [False, True])
    param_names = ["L", "causal"]
    repeat = (1, 3, 30.0)
    gflops_repeats = 2

    def setup(self, L, causal):
        self._setup(1, 4, L, 64, "float32", causal)

    def time_forward(self, L, causal):
        self._call()

    def track_gflops(self, L, causal):
        return self._gflops()

    track_gflops.unit = "GFLOP/s"


class Headline(_Forward):
    """The performance page's headline problems, float32 (compared there with torch)."""

    params = (["B1 H8 L2048 D64", "B1 H8 L2048 D64 causal", "B1 H4 L4096 D128"],)
    param_names = ["case"]
    _cases = {"B1 H8 L2048 D64": (1, 8, 2048, 64, False),
              "B1 H8 L2048 D64 causal": (1, 8, 2048, 64, True),
              "B1 H4 L4096 D128": (1, 4, 4096, 128, False)}

    def setup(self, case):
        b, h, L, e, causal = self._cases[case]
        self._setup(b, h, L, e, "float32", causal)

    def time_forward(self, case):
        self._call()

    def track_gflops(self, case):
        return self._gflops()

    track_gflops.unit = "GFLOP/s"


class PeakMemory:
    """Peak resident memory of a forward, B1 H1 D64 float32, L up to 16384.

    Extra memory must grow as O(L) (the inputs and output, 4 x L x 64 x 4 bytes: 4 MiB at
    L = 4096, 16 MiB at 16384), never O(L²): a materialized 16384² float32 score matrix
    alone would be 1 GiB. The kernels are compiled on a tiny problem in setup, so the large
    arrays exist only in the measured call.
    """

    params = ([4096, 8192, 16384],)
    param_names = ["L"]

    def setup(self, L):
        q, k, v = inputs(1, 1, 64, 64, "float32")
        sdpa(q, k, v)  # compile or load
        self.q, self.k, self.v = inputs(1, 1, L, 64, "float32")

    def peakmem_forward(self, L):
        sdpa(self.q, self.k, self.v)
