"""How the batch is split into kernel launches: one implementation for both targets.

The kernels take 4-D operands ``(batch, heads, rows, cols)``. The operands' batch dims (the
plan's ``batch``, any number) are merged into one where the strides of every operand allow
it (always, for contiguous or broadcast operands); otherwise the kernel is launched once per
index of the leading merged dim, recursively. The dropout argument gets each launch's batch
offset, so that the kernels' batch index stays the flat, row-major index into the whole batch:
the dropout mask does not depend on how the work was split.

Worked out on shapes and strides; a target gives its ``as_strided(x, shape, strides)``.
"""

import math


def merged_batch_dims(arrays, nb):
    """The ``nb`` batch dims of ``arrays`` merged where all their strides allow: a list of
    ``(size, [stride of each array])``, at least one entry (dims of size 1 are dropped; with
    no dim left, one dim of size 1)."""
    dims = []
    for d in range(nb):
        n = arrays[0].shape[d]
        st = [a.strides[d] for a in arrays]
        if n == 1:
            continue
        if dims and all(sp == n * s for sp, s in zip(dims[-1][1], st)):
            dims[-1] = (dims[-1][0] * n, st)
        else:
            dims.append((n, st))
    if not dims:  # all of size 1 (or none): keep the last one's strides, else stride 0
        dims = [(1, [a.strides[nb - 1] if nb else 0 for a in arrays])]
    return dims


def _restride(a, shape, strides, as_strided):
    if tuple(a.shape) == shape and tuple(a.strides) == strides:
        return a
    return as_strided(a, shape, strides)


def for_each_launch(batch, arrays, dropout, launch, as_strided):
    """Call ``launch(arrays4d, dropout)`` once per kernel launch that covers ``batch`` (the
    plan's batch shape).

    ``arrays``: the target's arrays with the ``len(batch)`` batch dims leading (None entries
    pass through as None). ``dropout``: None or :func:`sdpa_numba.dropout.params`, whose batch
    offset (its last entry) each launch gets shifted by the flat index of its first batch.
    """
    nb = len(batch)
    if nb == 1:  # one batch dim already: nothing to merge (the common case: keep it cheap)
        launch(arrays, dropout)
        return
    present = [a for a in arrays if a is not None]
    dims = merged_batch_dims(present, nb)
    shape = tuple(n for n, _ in dims)
    if len(dims) == nb:  # nothing merged nor dropped: the arrays as they are
        merged = present
    else:
        merged = [_restride(a, shape + tuple(a.shape[nb:]),
                            tuple(s[i] for _, s in dims) + tuple(a.strides[nb:]), as_strided)
                  for i, a in enumerate(present)]
    if len(dims) > 1:  # batch dims that no view can merge: one launch per leading index
        inner = math.prod(shape[1:])
        for i in range(shape[0]):
            sub = None if dropout is None else (*dropout[:3], dropout[3] + i * inner)
            for_each_launch(shape[1:], _put_back(arrays, [a[i] for a in merged]), sub, launch,
                            as_strided)
        return
    launch(_put_back(arrays, merged), dropout)


def _put_back(arrays, present):
    """``present`` in the places of the non-None entries of ``arrays``."""
    it = iter(present)
    return [None if a is None else next(it) for a in arrays]
