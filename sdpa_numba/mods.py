"""Functions for users' ``score_mod`` (jitted code, CPU): ``tanh``, a float32 tanh that
vectorizes (:func:`sdpa_numba.cpu.tanh.tanh`; ``math.tanh`` is a scalar library call), for a
soft cap written as a score_mod::

    @numba.njit
    def softcap(score, b, h, i, j):
        return 30.0 * tanh(score / 30.0)
"""

from .cpu.tanh import tanh

__all__ = ["tanh"]
