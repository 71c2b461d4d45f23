"""Ring attention: a causal sequence sharded over the ranks of an MPI job, forward and backward.

Each rank builds the same full arrays (a real job would load or compute only its own shard),
keeps its zigzag shard, runs ring attention and its backward, and checks the gathered result
against single-process attention on the full arrays.

Run: mpiexec -n 4 python docs/examples/ring_attention.py   (or plain python: one rank)
"""

import numpy as np
from mpi4py import MPI

import sdpa_numba
from sdpa_numba.distributed import ring_attention, ring_attention_backward, shard, unshard

comm = MPI.COMM_WORLD
P = comm.Get_size()
rng = np.random.default_rng(0)  # the same seed on every rank: the same full arrays
B, Hq, H, L, E = 1, 8, 2, 2 * P * 24, 32  # zigzag: L divisible by 2 P
q = rng.standard_normal((B, Hq, L, E))
k = rng.standard_normal((B, H, L, E))
v = rng.standard_normal((B, H, L, E))
grad_out = rng.standard_normal((B, Hq, L, E))

# This rank's shards: chunks r and 2P-1-r of the sequence (balanced causal work).
q_r, k_r, v_r, g_r = (shard(x, comm, "zigzag") for x in (q, k, v, grad_out))
out_r, lse_r = ring_attention(q_r, k_r, v_r, is_causal=True, enable_gqa=True, layout="zigzag",
                              return_lse=True)
dq_r, dk_r, dv_r = ring_attention_backward(g_r, q_r, k_r, v_r, out_r, lse_r, is_causal=True,
                                           enable_gqa=True, layout="zigzag")

# Gathered on every rank, the shards are single-process attention and its gradients.
out, lse = sdpa_numba.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True,
                                                   return_lse=True)
grads = sdpa_numba.scaled_dot_product_attention_backward(grad_out, q, k, v, out, lse,
                                                         is_causal=True, enable_gqa=True)
for name, mine, ref in [("out", out_r, out), ("dq", dq_r, grads[0]), ("dk", dk_r, grads[1]),
                        ("dv", dv_r, grads[2])]:
    whole = unshard(mine, comm, "zigzag")
    err = np.linalg.norm(whole - ref) / np.linalg.norm(ref)
    assert err < 1e-12, (name, err)
if comm.Get_rank() == 0:
    print(f"ring_attention: {P} rank(s), output and gradients match single-process attention")
