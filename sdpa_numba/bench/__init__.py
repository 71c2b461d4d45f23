"""The benchmarks of ``python -m sdpa_numba bench``, on the public functions only.

* :mod:`~sdpa_numba.bench.dense`: the dense forward against torch's SDPA and naive NumPy
  over a grid of cases or the ``headline`` preset;
* :mod:`~sdpa_numba.bench.variants`: the ``variants`` preset (soft cap, a user's score_mod,
  a sliding window against torch's ``flex_attention`` and SDPA);
* :mod:`~sdpa_numba.bench.decode`: the ``decode`` and ``decode-more`` presets
  (``attention_with_kvcache`` as bandwidth against a streaming read and torch);
* :mod:`~sdpa_numba.bench.varlen`: the ``varlen`` preset (packed ragged batches);
* :mod:`~sdpa_numba.bench.timing` (interleaved rounds, thread counts),
  :mod:`~sdpa_numba.bench.machine` (versions, CPU, CUDA, load) and
  :mod:`~sdpa_numba.bench.report` (the tables, the plot): what they share.

The dense and variants benchmarks' names (earlier ``sdpa_numba.bench``'s) are handed on here;
``visited_fraction`` is :func:`sdpa_numba.tiles.visited_fraction`.
"""

from .dense import (DTYPES, IMPLS, PRESETS, Case, grid, make_inputs, naive_numpy,
                    numpy_dtype, parse_case, prepare, run_cases, sgemm_rates, steps)
from .machine import (collect_info, cuda_status, host_cpu, load_average,
                      threading_layer)
from .timing import PAUSE, rel_error, set_threads, time_interleaved, torch_available
from .variants import (VARIANTS_CASE, VARIANTS_SOFTCAP, VARIANTS_WINDOW, format_variants,
                       run_variants)

__all__ = ["DTYPES", "IMPLS", "PRESETS", "Case", "grid", "make_inputs", "naive_numpy",
           "numpy_dtype", "parse_case", "prepare", "run_cases", "sgemm_rates", "steps",
           "collect_info", "cuda_status", "host_cpu", "load_average", "threading_layer",
           "PAUSE", "rel_error", "set_threads", "time_interleaved", "torch_available",
           "VARIANTS_CASE", "VARIANTS_SOFTCAP", "VARIANTS_WINDOW", "format_variants",
           "run_variants"]
