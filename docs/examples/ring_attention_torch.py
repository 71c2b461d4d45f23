"""Ring attention over torch.distributed: the MPI example's causal sequence, on torch tensors,
sharded over the processes of a gloo group launched by torchrun.

Run: torchrun --standalone --nproc-per-node 4 docs/examples/ring_attention_torch.py
(or plain python: a group of one process)
"""

import os
import tempfile

import torch
import torch.distributed as dist

import sdpa_numba
from sdpa_numba.distributed import ring_attention, ring_attention_backward, shard, unshard

if "RANK" in os.environ:  # under torchrun: RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT
    dist.init_process_group("gloo")
else:
    init = os.path.join(tempfile.mkdtemp(), "init")
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=0, world_size=1)
group = dist.group.WORLD  # or any ProcessGroup of the job (dist.new_group)
P = dist.get_world_size(group)
gen = torch.Generator().manual_seed(0)  # the same seed on every rank: the same full tensors
B, Hq, H, L, E = 1, 8, 2, 2 * P * 24, 32  # zigzag: L divisible by 2 P
q = torch.randn(B, Hq, L, E, dtype=torch.float64, generator=gen)
k = torch.randn(B, H, L, E, dtype=torch.float64, generator=gen)
v = torch.randn(B, H, L, E, dtype=torch.float64, generator=gen)
grad_out = torch.randn(B, Hq, L, E, dtype=torch.float64, generator=gen)

# This rank's shards (torch tensors in, torch tensors out); comm is the process group.
q_r, k_r, v_r, g_r = (shard(x, group, "zigzag") for x in (q, k, v, grad_out))
out_r, lse_r = ring_attention(q_r, k_r, v_r, comm=group, is_causal=True, enable_gqa=True,
                              layout="zigzag", return_lse=True)
dq_r, dk_r, dv_r = ring_attention_backward(g_r, q_r, k_r, v_r, out_r, lse_r, comm=group,
                                           is_causal=True, enable_gqa=True, layout="zigzag")

# Gathered on every rank, the shards are single-process attention and its gradients.
out, lse = sdpa_numba.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True,
                                                   return_lse=True)
grads = sdpa_numba.scaled_dot_product_attention_backward(grad_out, q, k, v, out, lse,
                                                         is_causal=True, enable_gqa=True)
for name, mine, ref in [("out", out_r, out), ("dq", dq_r, grads[0]), ("dk", dk_r, grads[1]),
                        ("dv", dv_r, grads[2])]:
    whole = unshard(mine, group, "zigzag")
    assert isinstance(whole, torch.Tensor)
    err = float(torch.linalg.norm(whole - ref) / torch.linalg.norm(ref))
    assert err < 1e-12, (name, err)
if dist.get_rank(group) == 0:
    print(f"ring_attention_torch: {P} process(es), output and gradients match single-process "
          f"attention")
dist.destroy_process_group()
