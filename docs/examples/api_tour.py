"""A tour of sdpa_numba.scaled_dot_product_attention: every argument once.

Run: python docs/examples/api_tour.py   (the tests run it too)
"""

import numpy as np

from sdpa_numba import scaled_dot_product_attention as sdpa
from sdpa_numba.reference import attention  # plain NumPy, float64: the yardstick


def rel_err(x, ref):
    return np.linalg.norm(np.asarray(x, np.float64) - ref) / np.linalg.norm(ref)


rng = np.random.default_rng(0)
B, H, L, S, E = 2, 4, 100, 120, 32
q = rng.standard_normal((B, H, L, E), dtype=np.float32)
k = rng.standard_normal((B, H, S, E), dtype=np.float32)
v = rng.standard_normal((B, H, S, E), dtype=np.float32)

# 1. The plain call: (B, H, L, E) x (B, H, S, E) x (B, H, S, Ev) -> (B, H, L, Ev).
out = sdpa(q, k, v)
assert out.shape == (B, H, L, E) and out.dtype == np.float32
assert rel_err(out, attention(q, k, v)[0]) < 1e-5

# 2. Causal: query i sees keys j <= i (top-left aligned, as torch).
out = sdpa(q, k, v, is_causal=True)
assert rel_err(out, attention(q, k, v, is_causal=True)[0]) < 1e-5

# 3. Masks broadcast to (B, H, L, S). bool: True takes part ...
keep = rng.random((L, S)) < 0.8
out = sdpa(q, k, v, attn_mask=keep)
assert rel_err(out, attention(q, k, v, attn_mask=keep)[0]) < 1e-5
# ... float: added to the scores (here a per-batch padding mask, -inf = ignored).
pad = np.zeros((B, 1, 1, S), np.float32)
pad[1, ..., 90:] = -np.inf  # the second sequence has only 90 keys
out = sdpa(q, k, v, attn_mask=pad, is_causal=True)  # both apply
assert rel_err(out, attention(q, k, v, attn_mask=pad, is_causal=True)[0]) < 1e-5

# 4. scale (default 1/sqrt(E)) and the log-sum-exp of each row's scores.
out, lse = sdpa(q, k, v, scale=0.1, return_lse=True)
ref_out, ref_lse = attention(q, k, v, scale=0.1)
assert lse.shape == (B, H, L) and np.allclose(lse, ref_lse, rtol=1e-5)

# 5. Grouped-query attention: 4 query heads share 2 key/value heads (head h uses h // 2).
k2, v2 = k[:, :2], v[:, :2]
out = sdpa(q, k2, v2, enable_gqa=True)
assert rel_err(out, attention(q, k2, v2, enable_gqa=True)[0]) < 1e-5

# 6. Write into your own buffer (no allocation): out= must have the result's shape and dtype.
buf = np.empty((B, H, L, E), np.float32)
assert sdpa(q, k, v, out=buf) is buf

# 7. Any strides, views read in place; 2-D inputs are one head; batch dims broadcast.
out = sdpa(q[:, :, ::2], k.transpose(0, 1, 3, 2).swapaxes(-1, -2), v)
one_head = sdpa(q[0, 0], k[0, 0], v[0, 0])  # (L, E)
shared_kv = sdpa(q, k[:1], v[:1])  # batch 1 broadcasts against batch B
assert one_head.shape == (L, E) and shared_kv.shape == (B, H, L, E)

# 8. float16 in, float16 out, float32 accumulators inside.
out16 = sdpa(q.astype(np.float16), k.astype(np.float16), v.astype(np.float16))
assert out16.dtype == np.float16
assert rel_err(out16, attention(q.astype(np.float16), k.astype(np.float16),
                                 v.astype(np.float16))[0]) < 1e-3

# 9. Bad input is refused before any kernel runs, with a message naming the argument.
try:
    sdpa(q, k[..., :16], v)
except ValueError as exc:
    print("ValueError:", exc)

# 10. Dropout of the probabilities (training): dropout_p in [0, 1), kept ones scaled by
# 1 / (1 - p). A seed makes the mask reproducible (the backward redraws the same one); without
# one, every call draws a fresh mask. lse is that of the softmax before dropout.
a, lse_a = sdpa(q, k, v, attn_mask=pad, dropout_p=0.1, seed=1234, return_lse=True)
b = sdpa(q, k, v, attn_mask=pad, dropout_p=0.1, seed=1234)
assert np.array_equal(a, b)
assert not np.array_equal(a, sdpa(q, k, v, attn_mask=pad, dropout_p=0.1, seed=1))
assert np.allclose(lse_a, sdpa(q, k, v, attn_mask=pad, return_lse=True)[1], rtol=1e-6)
try:
    sdpa(q, k, v, dropout_p=1.0)
except ValueError as exc:
    print("ValueError:", exc)

print("api_tour: all results match the float64 reference")
