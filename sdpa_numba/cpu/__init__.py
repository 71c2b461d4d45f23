"""CPU kernels (``@njit``), callable from users' own Numba code.

* :func:`forward`: batched 4-D forward, parallel over batch x head x query chunk;
* :func:`forward_head`: serial single-head 2-D forward;
* :func:`online_softmax_update`, :func:`online_softmax_finalize`: the online softmax step;
* :func:`backward`: batched 4-D backward (gradients of :func:`forward`), parallel over batch x
  key/value head x group of key blocks, deterministic;
* :func:`decode`, :func:`decode_serial`: attention of new query tokens against a paged
  key/value cache (split-KV, deterministic), the kernel of ``attention_with_kvcache``;
* :func:`varlen_forward`, :func:`varlen_backward`: attention on packed ragged batches
  (``(total, H, E)`` with ``cu_seqlens``), parallel over the whole batch's work list;
* :func:`merge_row`, :func:`merge_rows`, :func:`merge_weights`: the merge of attention states by
  their lse (:mod:`sdpa_numba.score.merge`, target-neutral).
"""

from .._runtime import stamp_caches
from .backward import backward
from .decode import decode, decode_serial
from .forward import forward, forward_head
from .from_python import explain_float16, one_type_per_argument
from .online_softmax import online_softmax_finalize, online_softmax_update
from ..score.merge import merge_row, merge_rows, merge_weights
from .varlen import varlen_backward, varlen_forward

# Before any kernel loads from Numba's cache: stale caches of edited helpers are not loaded.
stamp_caches()

for _kernel in (forward, forward_head, backward, online_softmax_update, online_softmax_finalize,
                decode, decode_serial, varlen_forward, varlen_backward):
    explain_float16(_kernel)
    one_type_per_argument(_kernel)
del _kernel

__all__ = ["forward", "forward_head", "backward", "online_softmax_update",
           "online_softmax_finalize", "decode", "decode_serial", "varlen_forward", "varlen_backward",
           "merge_row", "merge_rows", "merge_weights"]
