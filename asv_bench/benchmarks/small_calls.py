"""Small calls on the CPU: one query row against 512 keys (B1 H1 L1 S512 D64 float32), where
the arithmetic takes microseconds and what the caller waits for is the host's work around the
kernel (validation, views, planning, dispatch) and the kernel's fixed costs (issue 33).

Each sample is the mean of many back-to-back calls (asv's ``number``), so the figures are the
steady cost of a call, not the cost after an idle pause (``bench --preset decode``'s tiny case
times that). ``scripts/small_calls.py`` splits the same calls into kernel and host time and
times torch's SDPA beside them.

Commits without one of the functions raise NotImplementedError in setup (asv: skipped).
"""

import numpy as np

import sdpa_numba

#: The case: batch, heads, query rows, keys, head dim.
B, H, L, S, D = 1, 1, 1, 512, 64


def _need(name):
    fn = getattr(sdpa_numba, name, None)
    if fn is None:
        raise NotImplementedError(f"this commit has no {name}")
    return fn


class SmallCalls:
    """The dense forward and backward, varlen (one sequence) and merging two states."""

    params = (["forward", "backward", "varlen", "merge"],)
    param_names = ["function"]
    number = 200
    repeat = (1, 10, 10.0)
    warmup_time = 0.0  # setup calls each function once (compile or load) and warms up

    def setup(self, function):
        rng = np.random.default_rng(0)

        def f(*shape):
            return rng.standard_normal(shape, dtype=np.float32)

        sdpa = _need("scaled_dot_product_attention")
        q, k, v = f(B, H, L, D), f(B, H, S, D), f(B, H, S, D)
        if function == "forward":
            self.call = lambda: sdpa(q, k, v)
        elif function == "backward":
            bwd = _need("scaled_dot_product_attention_backward")
            out, lse = sdpa(q, k, v, return_lse=True)
            g = f(B, H, L, D)
            self.call = lambda: bwd(g, q, k, v, out, lse)
        elif function == "varlen":
            varlen = _need("varlen_attention")
            vq, vk, vv = f(L, H, D), f(S, H, D), f(S, H, D)
            cu_q, cu_k = np.array([0, L], np.int32), np.array([0, S], np.int32)
            self.call = lambda: varlen(vq, vk, vv, cu_q, cu_k)
        else:
            merge = _need("merge_attention_states")
            oa, la = sdpa(q, k, v, return_lse=True)
            ob, lb = sdpa(q, f(B, H, S, D), f(B, H, S, D), return_lse=True)
            self.call = lambda: merge(oa, la, ob, lb)
        for _ in range(20):
            self.call()

    def time_call(self, function):
        self.call()
