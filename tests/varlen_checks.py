"""Per-sequence float64 references of packed (varlen) batches, for the CPU and CUDA tests.

Each sequence ``b`` is checked against :mod:`sdpa_numba.reference` on a dense batch of ``b + 1``
entries holding the sequence at index ``b`` (the others zeros), so that the reference's ``b``
(ALiBi slopes, score_mod / mask_mod, the dropout stream) is the sequence index, as the varlen
API documents.
"""

import math

import numpy as np
from numba import njit

from checks import randn
from sdpa_numba import reference


def cu(lengths, dtype=np.int32):
    return np.concatenate([[0], np.cumsum(lengths)]).astype(dtype)


def packed(rng, lq, lk, hq, h, e, ev, dtype=np.float64):
    q = randn(rng, (sum(lq), hq, e), dtype)
    k = randn(rng, (sum(lk), h, e), dtype)
    v = randn(rng, (sum(lk), h, ev), dtype)
    return q, k, v


def embedded(x, c, b):
    """Sequence ``b`` of packed ``x`` as entry ``b`` of a zero batch of ``b + 1``: (b + 1, H, L,
    D) float64."""
    seq = np.asarray(x[c[b]:c[b + 1]], np.float64).transpose(1, 0, 2)
    full = np.zeros((b + 1, *seq.shape))
    full[b] = seq
    return full


def seq_kw(kw, b):
    """The variants for the embedded batch of sequence ``b``: per-sequence ALiBi slopes cut to
    its ``b + 1`` entries."""
    a = kw.get("alibi_slopes")
    if a is not None and np.ndim(a) == 2:
        kw = dict(kw, alibi_slopes=a[:b + 1])
    return kw


def per_sequence(f, q, k, v, cq, ck, *extra, **kw):
    """``f(q_b, k_b, v_b, *extra_b, enable_gqa=True, **kw)[i][b]`` for every sequence, the
    results packed back: out-like ones (4-D) along rows, lse-like ones (3-D) as (H, total)."""
    results = []
    for b in range(len(cq) - 1):
        args = [embedded(x, c, b) for x, c in ((q, cq), (k, ck), (v, ck))]
        args += [embedded(x, cq, b) for x in extra]
        results.append([None if r is None else np.asarray(r)[b]
                        for r in f(*args, **seq_kw(kw, b))])
    joined = []
    for i, r0 in enumerate(results[0]):
        if r0 is None or np.ndim(r0) < 2:
            joined.append(None)
        elif np.ndim(r0) == 3:
            joined.append(np.concatenate([r[i].transpose(1, 0, 2) for r in results]))
        else:
            joined.append(np.concatenate([r[i] for r in results], axis=1))
    return joined


def reference_forward(q, k, v, cq, ck, **kw):
    return per_sequence(reference.attention, q, k, v, cq, ck, enable_gqa=True, **kw)


def reference_grads(g, q, k, v, cq, ck, sinks=None, **kw):
    """Per-sequence reference gradients, packed; the sinks' gradient summed over sequences."""
    dq, dk, dv = np.zeros(q.shape), np.zeros(k.shape), np.zeros(v.shape)
    dsinks = 0.0
    for b in range(len(cq) - 1):
        args = [embedded(x, c, b) for x, c in ((g, cq), (q, cq), (k, ck), (v, ck))]
        r = reference.attention_backward(*args, enable_gqa=True, sinks=sinks, **seq_kw(kw, b))
        dq[cq[b]:cq[b + 1]] = r[0][b].transpose(1, 0, 2)
        dk[ck[b]:ck[b + 1]] = r[1][b].transpose(1, 0, 2)
        dv[ck[b]:ck[b + 1]] = r[2][b].transpose(1, 0, 2)
        if sinks is not None:
            dsinks = dsinks + r[4]
    return dq, dk, dv, dsinks


# --- the user's functions (shared by the CPU and CUDA tests) ------------------------------

@njit
def bias_mod(s, b, h, i, j, bias, keep):
    """A per-sequence, per-head bias that depends on the positions."""
    return s + bias[b, h] * math.cos(0.3 * (i - j))


@njit
def bias_mod_grad(s, b, h, i, j, bias, keep):
    return 1.0


@njit
def keep_mod(b, h, i, j, bias, keep):
    """Drops keys by a per-sequence pattern."""
    return (i + 2 * j + b) % keep[b] != 0
