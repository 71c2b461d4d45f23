"""JIT compile time, measured apart from the steady-state numbers (docs/performance.md).

Each figure is the first ``scaled_dot_product_attention`` call (float32, no mask) in a fresh
Python process whose ``NUMBA_CACHE_DIR`` points at a folder of its own:

* ``track_first_call_cold``: the folder is empty, so the kernels are compiled;
* ``track_first_call_cached``: the folder holds what the cold run saved, so the kernels are
  loaded from Numba's on-disk cache.

Interpreter start-up and ``import`` are not counted. The cold run happens once, in
``setup_cache`` (it takes ~20 s on 2 cores), and both figures are single samples.
"""

import json
import os
import subprocess
import sys

FIRST_CALL = """
import json, time
import numpy as np
import sdpa_numba
q, k, v = (np.random.default_rng(i).standard_normal((1, 2, 64, 64), dtype=np.float32)
           for i in range(3))
t0 = time.perf_counter()
sdpa_numba.scaled_dot_product_attention(q, k, v)
print(json.dumps(time.perf_counter() - t0))
"""


def first_call_seconds(cache_dir):
    """Seconds of the first call in a new interpreter using Numba cache folder ``cache_dir``."""
    env = dict(os.environ, NUMBA_CACHE_DIR=os.path.abspath(cache_dir))
    proc = subprocess.run([sys.executable, "-c", FIRST_CALL], env=env, capture_output=True,
                          text=True, timeout=900)
    if proc.returncode:
        raise RuntimeError(f"first-call subprocess failed:\n{proc.stderr}")
    return float(json.loads(proc.stdout.strip().splitlines()[-1]))


class CompileTime:
    timeout = 900

    def setup_cache(self):
        cache_dir = os.path.abspath("numba_cache")  # asv keeps setup_cache's folder for us
        os.makedirs(cache_dir, exist_ok=True)
        return {"cache_dir": cache_dir, "cold": first_call_seconds(cache_dir)}

    setup_cache.timeout = 900

    def track_first_call_cold(self, data):
        return data["cold"]

    track_first_call_cold.unit = "seconds"

    def track_first_call_cached(self, data):
        return first_call_seconds(data["cache_dir"])

    track_first_call_cached.unit = "seconds"
