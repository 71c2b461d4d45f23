"""The layouts people use: BHLD (torch's SDPA, this library's) and BLHD (FlashAttention's,
Hugging Face's projections before the transpose), through views and ``out=``: no copies.

The kernels read any strides, so a BLHD tensor is passed as its BHLD view
(``x.transpose(0, 2, 1, 3)``), and the output is written straight into a BLHD buffer through
the same kind of view. Packed QKV (one ``(B, L, 3, H, D)`` projection output) works the same way:
``q``, ``k`` and ``v`` are views into it.

Run: python docs/examples/layouts.py
"""

import numpy as np

from sdpa_numba import scaled_dot_product_attention as sdpa
from sdpa_numba.reference import attention

rng = np.random.default_rng(0)
B, L, H, D = 2, 37, 4, 16

# BLHD in, BLHD out: transposed views both ways.
q, k, v = (rng.standard_normal((B, L, H, D), dtype=np.float32) for _ in range(3))
out_blhd = np.empty((B, L, H, D), np.float32)
sdpa(q.transpose(0, 2, 1, 3), k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3),
     is_causal=True, out=out_blhd.transpose(0, 2, 1, 3))

# Packed QKV from one projection, (B, L, 3, H, D): three strided views, nothing copied.
qkv = rng.standard_normal((B, L, 3, H, D), dtype=np.float32)
q2, k2, v2 = (qkv[:, :, i].transpose(0, 2, 1, 3) for i in range(3))  # each (B, H, L, D)
out_bhld = sdpa(q2, k2, v2)

# Check both against the float64 reference on BHLD copies.
want, _ = attention(*(x.transpose(0, 2, 1, 3) for x in (q, k, v)), is_causal=True)
assert np.abs(out_blhd.transpose(0, 2, 1, 3) - want).max() < 1e-5
want2, _ = attention(q2, k2, v2)
assert np.abs(out_bhld - want2).max() < 1e-5
print("layouts: BLHD views in and out, packed QKV views: all match the float64 reference")
