"""The user's functions (score_mod, its score_mod_grad, mask_mod) shared by the tests of the
JAX bridge: one pair, defined once, so that every test file compiles the same dispatchers
(each new function is a new compiled specialization: tens of seconds).

Their mod_args are ``(slopes, ids, lim)``: a float array ``(Hq,)``, an int array ``(B, n)``
(a document id per batch entry / sequence and position) and a float scalar, so that together
they read every kind of mod_arg.
"""

from numba import njit


@njit
def tilt(s, b, h, i, j, slopes, ids, lim):
    # reads every kind of mod_arg: a float array, an int array and a float scalar
    return s + slopes[h] * (i - j) * lim + 0.01 * ids[b, j]


@njit
def tilt_grad(s, b, h, i, j, slopes, ids, lim):
    return 1.0


@njit
def same_doc(b, h, i, j, slopes, ids, lim):
    return ids[b, i] == ids[b, j]


MODS = dict(score_mod=tilt, mask_mod=same_doc)
