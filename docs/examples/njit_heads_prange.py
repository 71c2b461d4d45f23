"""Parallelize yourself: sdpa_numba.cpu.forward_head inside your own prange loop.

cpu.forward_head(q, k, v, mask, is_causal, scale, out, lse) computes one head on 2-D arrays,
(L, E), (S, E), (S, Ev) -> out (L, Ev), lse (L,), on the calling thread only, so each
iteration of a prange loop can run one head. Here: heads with different key lengths (a ragged
batch), which the 4-D batched kernel cannot take.

Run: python docs/examples/njit_heads_prange.py
"""

import numpy as np
from numba import njit, prange

from sdpa_numba import cpu
from sdpa_numba.reference import attention


@njit(parallel=True)
def ragged_attention(q, k, v, lengths, out, lse):
    """Head h attends to the first lengths[h] keys of its k[h], v[h]."""
    scale = 1.0 / np.sqrt(q.shape[2])
    for h in prange(q.shape[0]):
        n = lengths[h]
        cpu.forward_head(q[h], k[h, :n], v[h, :n], None, False, scale, out[h], lse[h])


rng = np.random.default_rng(2)
H, L, S, E = 6, 40, 64, 16
q = rng.standard_normal((H, L, E), dtype=np.float32)
k = rng.standard_normal((H, S, E), dtype=np.float32)
v = rng.standard_normal((H, S, E), dtype=np.float32)
lengths = np.array([64, 3, 17, 64, 33, 1])
out = np.empty((H, L, E), np.float32)
lse = np.empty((H, L), np.float32)  # the compute dtype: float32 for float32 inputs
ragged_attention(q, k, v, lengths, out, lse)

for h in range(H):
    n = lengths[h]
    ref, ref_lse = attention(q[h], k[h, :n], v[h, :n])
    assert np.linalg.norm(out[h] - ref) <= 1e-5 * np.linalg.norm(ref), h
    assert np.allclose(lse[h], ref_lse, rtol=1e-5), h
print("njit_heads_prange: every head matches the float64 reference")
