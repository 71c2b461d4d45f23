"""sdpa_numba without JAX: the package never imports it, and sdpa_numba.jax says which extra
it needs (no JAX needed to run these)."""

import subprocess
import sys

CODE_NO_JAX = """
import sys
sys.modules["jax"] = None  # as if JAX were not installed
import sdpa_numba
assert "jax" not in [m.split(".")[0] for m in sys.modules if sys.modules[m] is not None]
try:
    import sdpa_numba.jax
except ImportError as e:
    print("ImportError:", e)
"""


def test_package_imports_without_jax_and_names_the_extra():
    r = subprocess.run([sys.executable, "-c", CODE_NO_JAX], capture_output=True, text=True,
                       check=True)
    assert "ImportError:" in r.stdout
    assert "sdpa_numba[jax]" in r.stdout
