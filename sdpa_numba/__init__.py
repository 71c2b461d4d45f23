"""sdpa_numba: scaled dot-product attention kernels written with Numba.

``scaled_dot_product_attention`` takes NumPy arrays (CPU kernels) or CUDA arrays (CUDA
kernels). The jitted kernels themselves are in :mod:`sdpa_numba.cpu` and
:mod:`sdpa_numba.cuda` (imported lazily: no GPU or CUDA toolkit needed to import this package).
"""

from . import _finder, reference
from .api import scaled_dot_product_attention

_finder.install()  # before anything imports sdpa_numba.cuda

__version__ = "0.1.0"

__all__ = ["scaled_dot_product_attention", "reference", "__version__"]
