"""The PyTorch operator: ``sdpa_numba.torch.scaled_dot_product_attention``.

torch's signature and semantics, on sdpa_numba's kernels, registered with
:func:`torch.library.custom_op` so that the rest of PyTorch sees a real operator:

* ``torch.ops.sdpa_numba.attention_forward(query, key, value, attn_mask, dropout_p, is_causal,
  scale, enable_gqa, seed, window_left=None, window_right=None, alignment="top_left",
  softcap=None, alibi_slopes=None, sinks=None, chunk=None) -> (out, lse)`` and
  ``torch.ops.sdpa_numba.attention_backward(grad_out, query, key, value, out, lse, attn_mask,
  dropout_p, is_causal, scale, enable_gqa, seed, mask_grad, window_left=None,
  window_right=None, alignment="top_left", softcap=None, alibi_slopes=None, sinks=None,
  chunk=None) -> (dq, dk, dv, dmask, dsinks)``;
* the variants that fit an operator schema (see :func:`scaled_dot_product_attention`): a
  sliding window (its two sides as two optional ints), ``alignment``, ``softcap``, ``chunk``
  (an optional int),
  ``alibi_slopes`` and ``sinks`` (tensors; the sinks get a gradient). ``score_mod``,
  ``mask_mod`` and ``block_mask`` are Numba functions and objects, which no operator schema
  can carry: they stay with the NumPy-level :func:`sdpa_numba.scaled_dot_product_attention`;
* the serving functions: ``torch.ops.sdpa_numba.attention_with_kvcache(q, k_cache, v_cache,
  cache_seqlens, k=None, v=None, block_table=None, cache_leftpad=None, is_causal=True,
  scale=None, window_left=None, window_right=None, alignment=None, softcap=None,
  alibi_slopes=None, sinks=None, chunk=None) -> (out, lse)``, which declares the caches mutated (the
  append) and has no autograd (an inference operator), its read-only twin
  ``torch.ops.sdpa_numba.attention_with_kvcache_read`` (the same without ``k`` and ``v``: no
  declared mutation, whose dispatch is cheaper), and
  ``torch.ops.sdpa_numba.merge_attention_states(out_a, lse_a, out_b=None, lse_b=None)
  -> (out, lse)``, with autograd; wrapped by :func:`attention_with_kvcache` and
  :func:`merge_attention_states`; vmap rules for the read-only KV-cache op (the vmapped dim
  folds into the batch dim) and the merge; the appending op refuses vmap (an in-place write);
* packed ragged batches: ``torch.ops.sdpa_numba.varlen_attention_forward(q, k, v,
  cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, is_causal, scale, seed,
  <the dense op's variants>) -> (out, lse)`` and ``varlen_attention_backward(grad_out, q, k,
  v, out, lse, cu_seqlens_q, cu_seqlens_k, dropout_p, is_causal, scale, seed, <variants>)
  -> (dq, dk, dv, dsinks)``, with autograd (double backward per sequence through the dense
  torch formulation), wrapped by :func:`varlen_attention`;
* fake (meta) kernels for both, so ``torch.compile`` traces through them
  (``fullgraph=True`` works: no graph break) and meta tensors get shapes;
* autograd registered on the forward (gradients for query, key, value and a float
  ``attn_mask``), with double backward: under ``create_graph=True`` the first-order
  gradients are taken through the same attention written in torch operations (L x S memory,
  only then; with every variant of the schema), so that gradient penalties and
  Hessian-vector products get their second-order terms (under torch.compile, AOT autograd
  refuses double backward with its own message);
* vmap rules for both (the vmapped dim becomes one more leading batch dim, batched ALiBi
  slopes included; with sinks, or dropout, one call per vmapped index); torch.func's
  autodiff transforms (``grad``, ``jacrev``, ...) are not supported (NotImplementedError).

Devices: CPU tensors run on the CPU kernels through NumPy views (``tensor.numpy()``: no
copies); CUDA tensors run on the CUDA kernels through ``__cuda_array_interface__`` (no copies
either; numba-cuda and a GPU needed; Numba launches on the legacy default stream, so tensors
made on another torch stream must be synchronized first). dtypes: float16, bfloat16, float32,
float64 (bfloat16 goes through ``ml_dtypes.bfloat16`` NumPy views on the CPU, and int16 bit
patterns on either device, without copies; it needs the ml_dtypes package). Other devices raise NotImplementedError; meta tensors only get
shapes.

Dropout: the forward op takes ``seed``, a 0-dim int64 CPU tensor (or None when
``dropout_p == 0``), and the backward regenerates the same mask from it (see
:mod:`sdpa_numba.dropout`; the int64 is read as the uint64 with the same bits). The function
below draws it from torch's default (CPU) generator (``torch.randint``) when not given, so
``torch.manual_seed`` makes dropout reproducible and ``torch.compile`` keeps it random per call
(inductor draws from its own random stream, as for torch's dropout, unless
``torch._inductor.config.fallback_random`` is set).

Needs torch >= 2.4 (``custom_op``, ``register_fake``, ``register_autograd``); the vmap rules
need 2.5 (``register_vmap``) and are skipped before it. torch is an optional dependency (the
``torch`` extra): this package imports it, ``sdpa_numba`` does not. (``import torch`` in
its modules is an absolute import: the real torch, not this package.)

The package's modules: :mod:`~sdpa_numba.torch.tensors` (tensors in and out, the checks),
:mod:`~sdpa_numba.torch.dense`, :mod:`~sdpa_numba.torch.serving` and
:mod:`~sdpa_numba.torch.varlen` (the operators and their fake kernels),
:mod:`~sdpa_numba.torch.autograd` and :mod:`~sdpa_numba.torch.vmap` (their registrations),
:mod:`~sdpa_numba.torch.functions` (the functions above).
"""

import torch  # noqa: F401  (the real torch: ``sdpa_numba.torch.torch``)

from . import autograd, vmap  # noqa: F401  (registered on import)
from .dense import attention_backward, attention_forward
from .functions import (SDPAFunction, attention_with_kvcache, merge_attention_states,
                        scaled_dot_product_attention, varlen_attention)
from .serving import (attention_with_kvcache_op, attention_with_kvcache_read_op,
                      merge_attention_states_op)
from .varlen import varlen_attention_backward, varlen_attention_forward

__all__ = ["scaled_dot_product_attention", "attention_forward", "attention_backward",
           "varlen_attention", "varlen_attention_forward", "varlen_attention_backward",
           "attention_with_kvcache", "merge_attention_states", "attention_with_kvcache_op",
           "attention_with_kvcache_read_op",
           "merge_attention_states_op", "SDPAFunction"]
