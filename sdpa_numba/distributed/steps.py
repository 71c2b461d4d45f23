"""The work of one ring step: which dense calls (query rows, key rows, the recipe's offset
and window) a rank's queries make against the key/value shard it holds, and the plan of one
such call."""

import dataclasses

import numpy as np

from ..score.recipe import NO_LIMIT

# Every position-dependent variant (causality, the window, ALiBi) is a function of the global
# aligned row i' = gi + goff and the global key gj (goff = S - L for bottom-right alignment
# over the WHOLE sequence, else 0). A dense call on query rows starting at global row qs and
# keys starting at global key ks sees local rows i = gi - qs and keys j = gj - ks, so it runs
# the same variants with the recipe's offset qs - ks + goff: i + offset - j = gi' - gj.
# Causality is the window's right side 0 (folded in by the plan), so one mechanism serves all.

def _chunks(layout, n, size, rank):
    """The chunks of rank ``rank``'s shard: ``(local start, local stop, global start)``; one
    for "contiguous", two for "zigzag" (chunks ``rank`` and ``2 size - 1 - rank``)."""
    if layout == "contiguous":
        return [(0, n, rank * n)]
    c = n // 2
    return [(0, c, rank * c), (c, n, (2 * size - 1 - rank) * c)]


def _classify(nq, nk, offset, left, right):
    """"empty", "full" or "partial": which of the ``nq x nk`` (row, key) pairs of a dense call
    with this offset and window are seen (the window's rows are intervals that slide with
    the row, so the keys seen by any row form one interval)."""
    if nq <= 0 or nk <= 0:
        return "empty"
    if max(offset - left, 0) >= min(nq + offset + right, nk):
        return "empty"
    if nq - 1 + offset - left <= 0 and nk - 1 <= offset + right:
        return "full"
    return "partial"


def step_work(layout, n_q, n_k, size, rank, src, goff, left, right, alibi):
    """What rank ``rank``'s queries do against the key/value shard of rank ``src``: a list of
    ``(query rows, key rows, offset, left, right)`` (slices of the local shards and the
    recipe's window in the frame of that dense call), possibly empty.

    ``goff``: the global alignment offset; ``left``/``right``: the window (causality folded
    in; ``NO_LIMIT`` for unlimited); ``alibi``: whether the scores depend on ``|i' - j|``.
    Without a window or ALiBi the whole shard pair is one call. Otherwise the shard pair is one
    call when a single offset gives every chunk pair the right keys (e.g. the zigzag diagonal
    under causality: local causal is global causal there); else each chunk pair is trimmed to
    the rows that see a key and the keys that a row sees, empty ones are skipped, and wholly
    visible ones next to each other are joined (without ALiBi they need no offset).
    """
    whole = (slice(0, n_q), slice(0, n_k))
    if not alibi and left >= NO_LIMIT and right >= NO_LIMIT:
        return [(*whole, 0, NO_LIMIT, NO_LIMIT)]
    qch, kch = _chunks(layout, n_q, size, rank), _chunks(layout, n_k, size, src)
    o_one = qch[0][2] - kch[0][2] + goff  # the whole-shard call's offset (both start at 0)
    one = True
    for qa, qb, gq in qch:
        for ka, kb, gk in kch:
            o, o_call = gq - gk + goff, o_one + qa - ka
            if o == o_call:
                continue
            state = _classify(qb - qa, kb - ka, o, left, right)
            if alibi or state == "partial" or \
                    state != _classify(qb - qa, kb - ka, o_call, left, right):
                one = False
    if one:
        if _classify(n_q, n_k, o_one, left, right) == "empty":
            return []
        return [(*whole, o_one, left, right)]
    items = []
    for qa, qb, gq in qch:
        for ka, kb, gk in kch:
            o, nq, nk = gq - gk + goff, qb - qa, kb - ka
            # Rows that see a key: i + o - left <= nk - 1 and i + o + right >= 0.
            i0, i1 = max(-o - right, 0), min(nk - 1 - o + left, nq - 1)
            if i0 > i1:
                continue
            j0, j1 = max(i0 + o - left, 0), min(i1 + o + right, nk - 1)
            if j0 > j1:
                continue
            o2 = o + i0 - j0
            rows, keys = slice(qa + i0, qa + i1 + 1), slice(ka + j0, ka + j1 + 1)
            if not alibi and _classify(i1 - i0 + 1, j1 - j0 + 1, o2, left, right) == "full":
                items.append((rows, keys, 0, NO_LIMIT, NO_LIMIT))
            else:
                items.append((rows, keys, o2, left, right))
    return items if alibi else _join(items)


def _join(items):
    """Join wholly visible items (no window, no offset) that share their keys and have
    adjacent rows, or share their rows and have adjacent keys: fewer, larger dense calls.
    Without ALiBi only: with it, every call needs its true offset."""
    def free(it):
        return it[3] >= NO_LIMIT and it[4] >= NO_LIMIT

    joined = True
    while joined:
        joined = False
        for a in range(len(items)):
            for b in range(len(items)):
                x, y = items[a], items[b]
                if a == b or not (free(x) and free(y)):
                    continue
                if x[1] == y[1] and x[0].stop == y[0].start:
                    new = (slice(x[0].start, y[0].stop), x[1], 0, NO_LIMIT, NO_LIMIT)
                elif x[0] == y[0] and x[1].stop == y[1].start:
                    new = (x[0], slice(x[1].start, y[1].stop), 0, NO_LIMIT, NO_LIMIT)
                else:
                    continue
                items = [it for n, it in enumerate(items) if n not in (a, b)]
                items.insert(min(a, b), new)
                joined = True
                break
            if joined:
                break
    return items


def take_rows(x, s, axis=-2):
    index = [slice(None)] * x.ndim
    index[axis] = s
    return x[tuple(index)]


def block_plan(q, k, v, ring, offset, left, right):
    """The plan of one dense call: the ring's scale, GQA, soft cap and ALiBi, with the
    call's offset and window in its recipe (sinks are folded in once per row, by the ring)."""
    from ..problem import plan

    p = plan(q, k, v, None, False, ring.scale, ring.enable_gqa)
    r = ring.recipe._replace(offset=np.int64(offset), left=np.int64(left),
                             right=np.int64(right))
    return dataclasses.replace(p, recipe=r)
