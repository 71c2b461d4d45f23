"""The PyTorch operator (see :mod:`sdpa_numba.torch.functions`)."""

import torch  # noqa: F401

from .functions import *  # noqa: F401,F403
from .functions import __all__, _kvcache  # noqa: F401
