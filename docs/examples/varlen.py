"""A ragged batch packed back to back: varlen_attention (prefill of sequences of different
lengths, no padding) and its backward, checked against the float64 reference per sequence."""

import numpy as np

import sdpa_numba
from sdpa_numba.reference import attention, attention_backward

rng = np.random.default_rng(0)
Hq, H, E = 8, 2, 64                      # GQA: 4 query heads per key/value head
lengths = [37, 1, 0, 120]                # one sequence of 1 token, one empty
cu_seqlens = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)   # [0, 37, 38, 38, 158]
total = int(cu_seqlens[-1])
q = rng.standard_normal((total, Hq, E), dtype=np.float32)   # (total, heads, head dim)
k = rng.standard_normal((total, H, E), dtype=np.float32)
v = rng.standard_normal((total, H, E), dtype=np.float32)

out, lse = sdpa_numba.varlen_attention(q, k, v, cu_seqlens, cu_seqlens, is_causal=True,
                                       return_lse=True)
print(out.shape, lse.shape)              # (158, 8, 64) (8, 158): lse is (Hq, total_q)

# Each sequence attends to its own keys only: the dense call on that sequence alone.
for b in range(len(lengths)):
    rows = slice(cu_seqlens[b], cu_seqlens[b + 1])
    if lengths[b]:
        ref, _ = attention(q[rows].transpose(1, 0, 2), k[rows].transpose(1, 0, 2),
                           v[rows].transpose(1, 0, 2), is_causal=True, enable_gqa=True)
        assert np.allclose(out[rows], ref.transpose(1, 0, 2), atol=1e-5)

# The backward, for training on packed batches.
grad_out = rng.standard_normal(out.shape, dtype=np.float32)
dq, dk, dv = sdpa_numba.varlen_attention_backward(grad_out, q, k, v, out, lse, cu_seqlens,
                                                  cu_seqlens, is_causal=True)
rows = slice(cu_seqlens[3], cu_seqlens[4])
ref = attention_backward(*(x[rows].transpose(1, 0, 2) for x in (grad_out, q, k, v)),
                         is_causal=True, enable_gqa=True)
assert np.allclose(dk[rows], ref[1].transpose(1, 0, 2), atol=1e-4)

print("varlen: every sequence and the gradients match the float64 reference")
