"""Gradients of broadcast operands summed back to the operands' shapes: which axes to sum.

The backward kernels write gradients at the full broadcast shapes; an operand that was
broadcast (leading dims it lacks, dims stretched from 1) gets the sum over those axes.
:func:`broadcast_axes` is the rule; the summation is the target's (:func:`sum_to` with NumPy on
the host, :func:`sdpa_numba.gpu.reduce.sum_to` on the device, in a fixed order on both).
"""


def broadcast_axes(full, shape):
    """Axes of ``full`` along which an operand of ``shape`` was broadcast to reach it: the
    leading axes it lacks and the axes where it has 1 and ``full`` does not."""
    lead = len(full) - len(shape)
    return tuple(range(lead)) + tuple(lead + a for a, n in enumerate(shape)
                                      if n == 1 and full[lead + a] != 1)


def sum_to(x, shape):
    """NumPy array ``x`` summed over its :func:`broadcast_axes` down to ``shape``."""
    shape = tuple(shape)
    if x.shape == shape:  # nothing was broadcast (the common case: keep it cheap)
        return x
    lead = x.ndim - len(shape)
    axes = broadcast_axes(x.shape, shape)
    if lead:
        x = x.sum(axis=axes[:lead])
        axes = tuple(a - lead for a in axes[lead:])
    if axes:
        x = x.sum(axis=axes, keepdims=True)
    return x.reshape(shape)
