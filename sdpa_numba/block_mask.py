"""Block masks: which (query block, key block) pairs of a ``mask_mod`` are empty, full or partial.

FlexAttention's idea (torch's ``create_block_mask``), for this library's kernels: a
:class:`BlockMask` evaluates a ``mask_mod`` once over every (batch, head, query, key) and keeps,
per block of :data:`Q_BLOCK` queries by :data:`K_BLOCK` keys, one state:

* ``BLOCK_EMPTY``: no key of the block takes part in any of its rows: the kernels skip it;
* ``BLOCK_FULL``: every key takes part: the kernels skip the per-element ``mask_mod``;
* ``BLOCK_PARTIAL``: the kernels call ``mask_mod`` element by element.

The block sizes are the score seam's (:mod:`sdpa_numba.score.blocks`: 64 and 64, the CPU
forward's query sub-block and key block); other kernels read the states of the blocks their
tiles cover. Pass the result as ``scaled_dot_product_attention(..., mask_mod=f,
block_mask=bm)`` (or ``block_mask=bm`` alone: it carries its ``mask_mod``); it is reusable
across calls with the same shapes and the same ``mod_args`` contents — it is not recomputed,
so a block mask built for other ``mod_args`` gives wrong results. A call with a ``mask_mod``
and no block mask builds one for itself, under the call's window, except for small problems
(:mod:`sdpa_numba.problem.block_mask`, which builds them).
"""

from .problem.block_mask import create_block_mask
from .score.blocks import BLOCK_EMPTY, BLOCK_FULL, BLOCK_PARTIAL, K_BLOCK, Q_BLOCK, BlockMask

__all__ = ["BlockMask", "create_block_mask", "Q_BLOCK", "K_BLOCK", "BLOCK_EMPTY",
           "BLOCK_PARTIAL", "BLOCK_FULL"]
