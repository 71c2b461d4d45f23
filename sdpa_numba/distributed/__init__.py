"""Ring attention over MPI (mpi4py) or torch.distributed: exact attention on a sequence sharded
across processes.

Each rank of a communicator (an mpi4py communicator or a ``torch.distributed`` process group)
holds a shard of the queries, keys and values along the sequence
axis (the second-to-last axis). The key/value shards travel around the ring (rank ``r`` sends
to ``r + 1`` and receives from ``r - 1``) while each rank attends its queries to the shard it
holds; the partial results are combined exactly by their log-sum-exp
(:func:`~sdpa_numba.merge_attention_states`). After ``P`` steps every rank has the exact output
of its queries against the whole sequence. The backward keeps dQ on its rank and sends dK/dV
around the ring with the keys they belong to, back to their owners (Liu et al. 2023, "Ring
attention with blockwise transformers"; the zigzag layout and the backward's schedule follow
zhuzilin/ring-flash-attention). Only keys, values and their gradients travel; scores never do.

* Layouts. ``"contiguous"``: rank ``r`` of ``P`` holds rows ``[r n, (r + 1) n)`` of the
  sequence. ``"zigzag"``: the sequence is cut into ``2 P`` equal chunks and rank ``r`` holds
  chunks ``r`` and ``2 P - 1 - r``, concatenated; with ``is_causal`` every rank then does the
  same work at every step (half of a full block), where the contiguous layout leaves rank 0
  idle for all but one step. :func:`shard` and :func:`unshard` convert full arrays to and
  from either layout.
* Determinism. Every rank merges its partial results in a fixed order (ring step 0, 1, ...)
  and every dK/dV is accumulated in a fixed order (its owner's contribution first, then the
  next ranks' in ring order), on top of kernels whose results do not depend on the thread
  count: repeated runs give bitwise the same result for any thread count (not, in general,
  for another number of ranks: the sums are grouped differently).
* Overlap. The next key/value shard is posted (``Isend``/``Irecv``) before the current one is
  computed, and a dK/dV shard travels while the next step is computed. Whether the transfer
  really progresses during the computation is the MPI library's business: over shared memory
  and most network transports large messages move at the next MPI call unless the library
  runs an asynchronous progress thread (MPICH: ``MPICH_ASYNC_PROGRESS=1``, which costs a core).
  On a cluster, see docs/distributed.md for when the transfer is hidden at all. On a
  ``torch.distributed`` group (gloo) the bytes move on gloo's own I/O thread.
* Errors. Arguments are checked on every rank, then compared across ranks (one small
  ``allgather``) before anything is computed; after every ring step the ranks exchange an
  error flag, so that an exception on one rank (bad input, a failing kernel) is raised on every
  rank instead of leaving the others waiting for a message that never comes.
* Variants. ``window``, ``alignment``, ``is_causal`` and ``alibi_slopes`` act on the global
  positions: each dense call runs with the recipe offset ``qs - ks + offset`` (its first
  query row's and first key's global positions, and the whole sequence's alignment offset),
  so that ``i' - j`` is the global one; ``softcap`` is local to each score; ``sinks`` join each
  row once, after the last step. Work a window leaves empty is skipped (the shards still
  travel). ``score_mod``/``mask_mod``/``block_mask`` are refused (they see one call's
  positions); so is a dense ``attn_mask``.
* CUDA arrays (Numba device arrays, CuPy, torch CUDA tensors) run on the GPU launchers, their
  partial results merged and summed on the device (:mod:`sdpa_numba.gpu.ring`). The shards
  go to MPI as device buffers when the MPI library is CUDA-aware (:func:`mpi_cuda_aware`:
  ``MPIX_Query_cuda_support``, overridden by ``SDPA_NUMBA_MPI_CUDA_AWARE=0/1``), else
  through host buffers (a copy each way per message); the CUDA simulator's arrays are always
  staged. See docs/distributed.md.

* torch.distributed. ``comm`` may be a ``torch.distributed.ProcessGroup`` (e.g.
  ``torch.distributed.group.WORLD`` under ``torchrun``) whose backend moves CPU tensors
  (gloo); torch CPU tensors in, torch tensors out. The messages use the caller's group, kept
  apart by their tags (:mod:`~sdpa_numba.distributed.torch_group` says why not a duplicate);
  CUDA arrays are staged through host buffers; NCCL-only groups are refused.

The package's modules: :mod:`~sdpa_numba.distributed.transport` (what the ring needs of a
communication library, the exchange with the ring's neighbours, the choice of transport),
:mod:`~sdpa_numba.distributed.mpi` (mpi4py, the communicator, ``MPIGroup``),
:mod:`~sdpa_numba.distributed.torch_group` (a ``torch.distributed`` process group),
:mod:`~sdpa_numba.distributed.layouts` (the sharding
layouts), :mod:`~sdpa_numba.distributed.agreement` (the ranks agree on the arguments and on
failures), :mod:`~sdpa_numba.distributed.call` (the validated call),
:mod:`~sdpa_numba.distributed.steps` (the work of one ring step; the buffer operations and
the dense calls are the target's, :mod:`sdpa_numba.targets`),
:mod:`~sdpa_numba.distributed.ring_forward` and :mod:`~sdpa_numba.distributed.ring_backward`.

mpi4py is imported when a function here is called with an MPI communicator (or none), torch
when one is called with a process group; neither when this package is imported.
"""

from .layouts import LAYOUTS, shard, shard_rows, unshard
from .mpi import CUDA_AWARE_ENV, mpi_cuda_aware
from .ring_backward import ring_attention_backward
from .ring_forward import ring_attention

__all__ = ["ring_attention", "ring_attention_backward", "shard", "unshard", "shard_rows",
           "mpi_cuda_aware", "LAYOUTS", "CUDA_AWARE_ENV"]
