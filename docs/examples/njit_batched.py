"""Call the batched CPU kernel, sdpa_numba.cpu.forward, from your own @njit function.

cpu.forward(q, k, v, mask, is_causal, scale, out, lse) works on 4-D (B, H, L, E) arrays of
any strides, runs in parallel over batch x head x query block (also when called from a plain
@njit function), and writes out (B, H, L, Ev) and lse (B, H, L). lse is float32 for float32
inputs, float64 for float64. There is no validation at this level: shapes must be right.

Run: python docs/examples/njit_batched.py
"""

import numpy as np
from numba import njit

from sdpa_numba import cpu
from sdpa_numba.reference import attention


@njit
def causal_attention_plus_residual(x, q, k, v):
    """x + causal attention(q, k, v): the shape of a transformer block's first half."""
    b_len, h, L, _ = q.shape
    out = np.empty((b_len, h, L, v.shape[3]), np.float32)
    lse = np.empty((b_len, h, L), np.float32)  # float32 inputs: float32 lse
    cpu.forward(q, k, v, None, True, 1.0 / np.sqrt(q.shape[3]), out, lse)
    return x + out, lse


rng = np.random.default_rng(1)
B, H, L, E = 2, 4, 50, 16
x, q, k, v = (rng.standard_normal((B, H, L, E), dtype=np.float32) for _ in range(4))
y, lse = causal_attention_plus_residual(x, q, k, v)

ref, ref_lse = attention(q, k, v, is_causal=True)
err = np.linalg.norm(y - x - ref) / np.linalg.norm(ref)
assert err < 1e-5, err
assert np.allclose(lse, ref_lse, rtol=1e-5)
print(f"njit_batched: relative error {err:.1e}")
