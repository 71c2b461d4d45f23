"""CUDA kernels (``@cuda.jit``) and device functions, callable from users' own Numba code.

* :func:`forward`: launches the batched 4-D forward kernel (FlashAttention-2 style tiling,
  see :mod:`sdpa_numba.gpu.forward`), with optional dropout and a score recipe
  (``recipe=``: window, alignment, soft cap, ALiBi, sinks, the user's ``@njit``
  score_mod/mask_mod compiled in as device functions, block mask; see
  :mod:`sdpa_numba.score.recipe` and :mod:`sdpa_numba.gpu.variants`);
* :func:`backward`: launches the two kernels of the deterministic backward
  (:mod:`sdpa_numba.gpu.backward`), with the same recipe;
* :class:`Blocks`: its tiling; ``sdpa_numba.gpu.options.BLOCKS`` overrides the launcher's
  choice;
* device functions for users' kernels: :func:`attend_row` (one query row against a key/value
  block), :func:`attend_row_recipe` (the same with the scores formed by a score recipe: the
  variants in users' kernels), :func:`online_softmax_update` (the online-softmax step),
  :func:`online_softmax_lse` and :func:`online_softmax_finalize`; :func:`row_key` and
  :func:`dropout_factor`, the dropout
  stream (the same bits as the CPU kernels, :mod:`sdpa_numba.gpu.dropout`); :func:`merge_row`,
  :func:`merge_rows` and :func:`merge_weights`, the merge of attention states by their lse
  (:mod:`sdpa_numba.gpu.merge`).

Importing this module imports ``numba.cuda`` (the numba-cuda package); importing
``sdpa_numba`` does not. Set ``NUMBA_ENABLE_CUDASIM=1`` before that import to run everything on
Numba's CUDA simulator (slow; no GPU needed).
"""

try:
    import numba_cuda  # noqa: F401  (numba.cuda itself may resolve to Numba's old built-in)
except ImportError as exc:
    raise ImportError("sdpa_numba.gpu needs the numba-cuda package: "
                      "pip install 'sdpa_numba[cuda]'") from exc

from .backward import backward  # noqa: E402
from .dropout import dropout_factor, row_key  # noqa: E402
from .forward import forward  # noqa: E402
from .merge import merge_row, merge_rows, merge_weights  # noqa: E402
from .online_softmax import (  # noqa: E402
    attend_row,
    attend_row_recipe,
    online_softmax_finalize,
    online_softmax_lse,
    online_softmax_update,
)
from .options import Blocks  # noqa: E402

__all__ = ["forward", "backward", "Blocks", "attend_row", "attend_row_recipe",
           "online_softmax_update", "online_softmax_lse", "online_softmax_finalize", "row_key",
           "dropout_factor",
           "merge_row", "merge_rows", "merge_weights"]
