"""Decode on the CPU (``attention_with_kvcache``): one new token against a key/value cache,
as GB/s of K and V read (memory-bound work is measured in bytes, not FLOPs).

Commits older than the serving API have no ``attention_with_kvcache``: setup raises
NotImplementedError there, which asv records as skipped.
"""

import numpy as np

import sdpa_numba

from .common import min_time


class Decode:
    """B1 Lq1 float32, D128: MHA (Hq = H = 32) and GQA (Hq 32, H 8), contiguous cache."""

    params = ([1024, 8192], ["mha", "gqa"])
    param_names = ["S", "heads"]
    number = 1
    repeat = (1, 20, 20.0)
    warmup_time = 0.0

    def setup(self, S, heads):
        fn = getattr(sdpa_numba, "attention_with_kvcache", None)
        if fn is None:
            raise NotImplementedError("this commit has no attention_with_kvcache")
        hq, h = (32, 32) if heads == "mha" else (32, 8)
        rng = np.random.default_rng(0)
        self.q = rng.standard_normal((1, 1, hq, 128), dtype=np.float32)
        self.k = rng.standard_normal((1, S, h, 128), dtype=np.float32)
        self.v = rng.standard_normal((1, S, h, 128), dtype=np.float32)
        self.seqlens = np.array([S], np.int32)
        self.bytes = self.k.nbytes + self.v.nbytes
        self._fn = fn
        self._call()  # compile or load, warm up

    def _call(self):
        self._fn(self.q, self.k, self.v, self.seqlens)

    def time_decode(self, S, heads):
        self._call()

    def track_gb_per_s(self, S, heads):
        return self.bytes / min_time(self._call, 5) / 1e9

    track_gb_per_s.unit = "GB/s"


class DecodeQuant:
    """Decode over an 8-bit cache (MHA B1 H32 S8192 D128, float32 queries): its speed against
    the float caches' in class Decode, and its bytes read per second.

    Commits before the quantized caches have no ``quantize_kv``: setup raises
    NotImplementedError there (skipped)."""

    params = (["int8", "q8_0", "e4m3fn"],)
    param_names = ["format"]
    number = 1
    repeat = (1, 20, 20.0)
    warmup_time = 0.0

    def setup(self, format):
        quantize_kv = getattr(sdpa_numba, "quantize_kv", None)
        if quantize_kv is None:
            raise NotImplementedError("this commit has no quantized KV caches")
        rng = np.random.default_rng(0)
        S, h = 8192, 32
        self.q = rng.standard_normal((1, 1, h, 128), dtype=np.float32)
        self.k, self.k_scale = quantize_kv(rng.standard_normal((1, S, h, 128)), format)
        self.v, self.v_scale = quantize_kv(rng.standard_normal((1, S, h, 128)), format)
        self.seqlens = np.array([S], np.int32)
        self.bytes = sum(x.nbytes for x in (self.k, self.v, self.k_scale, self.v_scale))
        self._call()  # compile or load, warm up

    def _call(self):
        sdpa_numba.attention_with_kvcache(self.q, self.k, self.v, self.seqlens,
                                          k_scale=self.k_scale, v_scale=self.v_scale)

    def time_decode(self, format):
        self._call()

    def track_gb_per_s(self, format):
        return self.bytes / min_time(self._call, 5) / 1e9

    track_gb_per_s.unit = "GB/s"
