"""``python -m sdpa_numba``: see :mod:`sdpa_numba.cli` (also installed as ``sdpa-numba``)."""

import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
