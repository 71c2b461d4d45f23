"""sdpa_numba: scaled dot-product attention kernels written with Numba.

``scaled_dot_product_attention`` takes NumPy arrays (CPU kernels) or CUDA arrays (CUDA
kernels), with the attention variants as keywords (windows, soft cap, ALiBi, sinks, the user's
``score_mod``/``mask_mod``, block masks from ``create_block_mask``);
``scaled_dot_product_attention_backward`` gives its gradients; ``merge_attention_states``
combines attention over disjoint key sets by their log-sum-exp; ``attention_with_kvcache``
attends new tokens to a key/value cache (decode, contiguous or paged), and
``kvcache_plan`` plans such a step once for every layer of a model, and ``cascade_attention``
attends a batch that shares a prefix to it once per batch;
``varlen_attention`` (and its backward) runs ragged batches packed back to back; ``warmup``
compiles the CPU kernels into Numba's on-disk cache ahead of time. The jitted kernels
themselves are in :mod:`sdpa_numba.cpu` and :mod:`sdpa_numba.gpu` (the CUDA kernels, imported
lazily: no GPU or CUDA toolkit needed to import this package). :mod:`sdpa_numba.dropout`
describes the dropout mask's random stream; :mod:`sdpa_numba.torch` (needs torch, not imported
here) is the PyTorch operator.
"""

from . import _runtime, dropout, reference
from .api import scaled_dot_product_attention
from .backward import scaled_dot_product_attention_backward
from .cascade import cascade_attention
from .block_mask import BLOCK_EMPTY, BLOCK_FULL, BLOCK_PARTIAL, BlockMask, create_block_mask
from .kvcache import KVCachePlan, attention_with_kvcache, kvcache_plan
from .merge import merge_attention_states
from .precompile import warmup
from .quant import dequantize_kv, quantize_kv
from .varlen import varlen_attention, varlen_attention_backward

_runtime.choose_threading_layer()  # before the first parallel launch

__version__ = "0.1.0"

__all__ = ["scaled_dot_product_attention", "scaled_dot_product_attention_backward",
           "attention_with_kvcache", "kvcache_plan", "KVCachePlan", "cascade_attention",
           "merge_attention_states",
           "varlen_attention", "varlen_attention_backward", "BlockMask", "create_block_mask",
           "BLOCK_EMPTY", "BLOCK_PARTIAL", "BLOCK_FULL", "dropout", "reference", "warmup",
           "quantize_kv", "dequantize_kv", "__version__"]
