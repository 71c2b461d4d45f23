"""The score recipe (:mod:`sdpa_numba.score.recipe`) on the GPU: one kernel argument and back.

A CUDA kernel cannot take None or a function as an argument. So a host
:class:`~sdpa_numba.score.recipe.Recipe` travels as one :class:`RecipeArg`, a named tuple made
from the recipe's own fields:

* its run-time numbers (:data:`~sdpa_numba.score.recipe.NUMBERS`: offset, window, chunk, soft
  cap, batch offset): dense, causal, windowed, chunked, bottom-right and soft-capped attention
  share one compiled kernel;
* each optional array (every field that is neither a number, a user function nor
  ``mod_args``: ALiBi slopes, sinks, block mask) as a tuple of zero or one array, and the
  block mask's block sizes as two more numbers; ``mod_args`` as the tuple it is (an empty tuple
  is no kernel argument at all);

while the user's functions (``score_mod``, ``mask_mod``, ``score_mod_grad``) are closed over by
the kernel factory, which is cached per :func:`compile_key`. Numba passes a named tuple as its
fields, so the kernel's parameters are the same as if each were its own. Because every part of
this module is derived from the recipe's fields, an array-valued variant added to the recipe
reaches the CUDA kernels with no change here.

:func:`recipe_of` rebuilds the Recipe inside the kernel, so that the kernels call the same
jitted score functions as the CPU. The attention mask travels the same way (:func:`masked`): an
empty tuple is "no mask", the one encoding of it (no operand stands in for it); the backward's
mask gradient likewise (:func:`store_grad`).

On Numba's CUDA simulator the kernels run as Python and call the score functions as CPU-jitted
code, which cannot take the simulator's arrays: :func:`recipe_of` hands them their NumPy arrays.
"""

from collections import namedtuple

import numba
import numpy as np
from numba import njit, types
from numba.extending import overload

from ..options import INLINE
from ..score.recipe import BLOCK_FULL, BLOCK_PARTIAL, NUMBERS, Recipe, covered_block_state, \
    modifies_scores, sink_logit, window_covers
from .storage import load

__all__ = ["RecipeArg", "Parts", "compile_key", "arg_type", "kernel_args", "recipe_of",
           "copy_to_device", "device_recipe", "masked", "store_grad", "tile_state", "tile_visit",
           "sink_of", "modifies", "NO_MASK"]

#: The attention-mask argument of a kernel without a mask.
NO_MASK = ()

#: The recipe's user functions: compiled into a kernel, never passed to it.
FUNCTIONS = ("score_mod", "mask_mod", "score_mod_grad")

#: The recipe's numbers that are floats (the others are int64).
_FLOAT_NUMBERS = ("softcap",)

#: The recipe's optional arrays: every field that is not a number, a function or mod_args.
ARRAYS = tuple(f for f in Recipe._fields if f not in NUMBERS + FUNCTIONS + ("mod_args",))

#: A host recipe as one kernel argument (see the module doc; :func:`kernel_args`):
#: the numbers, then () or (array,) for each optional array, the block mask's query rows and
#: keys per block, and the tuple of mod_args.
RecipeArg = namedtuple("RecipeArg", NUMBERS + ARRAYS + ("bq", "bk", "mod_args"))


class Parts(namedtuple("Parts", ["arrays", "score_mod", "mask_mod", "score_mod_grad",
                                 "mod_types"])):
    """What of a recipe a compiled kernel depends on (hashable; :func:`compile_key`):
    ``arrays``, ``(name, ndim, dtype)`` of each optional array present; the user's functions
    (by identity); ``mod_types``, the Numba types of ``mod_args``."""

    __slots__ = ()

    def has(self, name):
        """Whether the optional array ``name`` (a recipe field) is present."""
        return any(a[0] == name for a in self.arrays)

    @property
    def functions(self):
        """The user's functions, ``(score_mod, mask_mod, score_mod_grad)``."""
        return self.score_mod, self.mask_mod, self.score_mod_grad


def _a(t):
    """An 'A'-layout array type of Numba type ``t`` (arrays), else ``t``."""
    return t.copy(layout="A") if isinstance(t, types.Array) else t


def _type_of(x):
    """The kernel-argument Numba type of a ``mod_args`` entry: arrays of any layout share one."""
    if isinstance(x, (bool, np.bool_)):
        return types.boolean
    if isinstance(x, (int, np.integer)):
        return types.int64
    if isinstance(x, (float, np.floating)):
        return types.float64
    return _a(numba.typeof(x))


def compile_key(r):
    """The :class:`Parts` of recipe ``r``: which optional arrays are present (with their rank
    and dtype), the user's functions and the types of ``mod_args``."""
    arrays = tuple((f, getattr(r, f).ndim, np.dtype(getattr(r, f).dtype)) for f in ARRAYS
                   if getattr(r, f) is not None)
    return Parts(arrays, r.score_mod, r.mask_mod, r.score_mod_grad,
                 tuple(_type_of(x) for x in r.mod_args))


def arg_type(parts, ct=None):
    """The Numba type of :func:`kernel_args` for compile key ``parts`` (a :class:`Parts`): a
    named tuple of :class:`RecipeArg`. ``ct``, the compute type, is not needed (each array
    carries its own dtype) and kept for callers that pass it."""
    present = {name: (ndim, dtype) for name, ndim, dtype in parts.arrays}

    def opt(f):
        if f not in present:
            return types.Tuple(())
        ndim, dtype = present[f]
        return types.UniTuple(types.Array(numba.from_dtype(dtype), ndim, "A"), 1)

    return types.NamedTuple(
        tuple(types.float64 if f in _FLOAT_NUMBERS else types.int64 for f in NUMBERS)
        + tuple(opt(f) for f in ARRAYS) + (types.int64, types.int64, types.Tuple(parts.mod_types)),
        RecipeArg)


def _device(x, to_device):
    return to_device(x) if isinstance(x, np.ndarray) else x


def kernel_args(r, block_sizes=(1, 1), to_device=None):
    """The kernel argument of host recipe ``r``: a :class:`RecipeArg` (see the module doc), of
    :func:`arg_type`'s type. ``block_sizes``: the block mask's (query rows, keys) per block.
    ``to_device``: copies NumPy arrays (the optional arrays and ``mod_args``) to the device
    (default :func:`numba.cuda.to_device`)."""
    if to_device is None:
        from numba import cuda
        to_device = cuda.to_device

    def opt(x):
        return () if x is None else (_device(x, to_device),)

    mod_args = tuple(_device(x, to_device) if isinstance(x, np.ndarray) else
                     (bool(x) if isinstance(x, (bool, np.bool_)) else
                      int(x) if isinstance(x, (int, np.integer)) else
                      float(x) if isinstance(x, (float, np.floating)) else x)
                     for x in r.mod_args)
    numbers = tuple(float(getattr(r, f)) if f in _FLOAT_NUMBERS else np.int64(getattr(r, f))
                    for f in NUMBERS)
    return RecipeArg(*numbers, *(opt(getattr(r, f)) for f in ARRAYS),
                     np.int64(block_sizes[0]), np.int64(block_sizes[1]), mod_args)


def copy_to_device(r):
    """Recipe ``r`` with its NumPy arrays (any optional array, and ``mod_args``) copied to the
    device: a launcher's, once per call rather than once per launch."""
    from numba import cuda

    def dev(x):
        return cuda.to_device(np.ascontiguousarray(x)) if isinstance(x, np.ndarray) else x

    return r._replace(**{f: dev(x) for f, x in zip(r._fields, r) if isinstance(x, np.ndarray)},
                      mod_args=tuple(dev(x) for x in r.mod_args))


# --- inside the kernels -------------------------------------------------------------------

def _host(x):
    """The NumPy array of a simulator array (inside a simulated kernel), else ``x``."""
    x = getattr(x, "_item", x)  # an array argument of the kernel itself
    return getattr(x, "_ary", x)


def recipe_of(ra, offset, score_mod, mask_mod, score_mod_grad):
    """The :class:`~sdpa_numba.score.recipe.Recipe` of kernel argument ``ra`` (a
    :class:`RecipeArg`) at ``offset`` (the work item's: per sequence in a packed batch); the
    functions are the kernel factory's. Device code (and simulator Python)."""
    fields = {f: getattr(ra, f) for f in NUMBERS}
    fields.update({f: _host(getattr(ra, f)[0]) if getattr(ra, f) else None for f in ARRAYS})
    fields.update(offset=offset, score_mod=score_mod, mask_mod=mask_mod,
                  score_mod_grad=score_mod_grad, mod_args=tuple(_host(x) for x in ra.mod_args))
    return Recipe(**fields)


@overload(recipe_of, target="generic")
def _recipe_of(ra, offset, score_mod, mask_mod, score_mod_grad):
    # Resolved by type: an absent array is None in the recipe, so the score functions drop it
    # at compile time. Branches on constants are not pruned before typing, so the recipe's
    # constructor call is written out for the parts present.
    present = {f: len(t.types) > 0 for f, t in zip(ra.fields, ra.types) if f in ARRAYS}
    parts = ["offset" if f == "offset" else f if f in FUNCTIONS else
             (f"ra.{f}[0]" if present[f] else "None") if f in ARRAYS else f"ra.{f}"
             for f in Recipe._fields]
    src = (f"def impl(ra, offset, score_mod, mask_mod, score_mod_grad):\n"
           f"    return Recipe({', '.join(parts)})\n")
    ns = {"Recipe": Recipe}
    exec(src, ns)  # noqa: S102 - source made from the recipe's field names and types
    return ns["impl"]


def masked(s, mask_t, b, h, i, j, neg_inf):
    """Score ``s`` of query ``i`` and key ``j`` under the attention mask ``mask_t`` (an empty
    tuple: no mask; else a 1-tuple of the mask, read in place): ``neg_inf`` where a bool mask
    is False (even for a NaN score, as torch's masked fill), else ``s``; for a float mask,
    ``s`` plus the mask's value."""
    if not mask_t:
        return s
    mask = mask_t[0]
    if mask.dtype == np.bool_:
        return s if mask[b, h, i, j] else neg_inf
    return s + load(mask[b, h, i, j])


@overload(masked, target="generic")
def _masked(s, mask_t, b, h, i, j, neg_inf):
    if len(mask_t.types) == 0:
        return lambda s, mask_t, b, h, i, j, neg_inf: s
    if mask_t.types[0].dtype == types.boolean:
        return lambda s, mask_t, b, h, i, j, neg_inf: s if mask_t[0][b, h, i, j] else neg_inf
    return lambda s, mask_t, b, h, i, j, neg_inf: s + load(mask_t[0][b, h, i, j])


def device_recipe(r):
    """Recipe ``r`` as the score functions take it in device code: ``r`` itself on a GPU; on
    the simulator (device code runs as Python, the score functions as CPU-jitted code), with
    its arrays as their NumPy arrays. For device functions that take a user's recipe."""
    return r._replace(**{f: _host(x) for f, x in zip(r._fields, r) if f != "mod_args"},
                      mod_args=tuple(_host(x) for x in r.mod_args))


@overload(device_recipe, target="generic")
def _device_recipe(r):
    return lambda r: r


def store_grad(grad_t, b, h, i, j, x):
    """``grad_t[0][b, h, i, j] = x``, or nothing for an empty tuple ("no gradient wanted":
    the mask gradient's one encoding, as :data:`NO_MASK` is the mask's)."""
    if grad_t:
        grad_t[0][b, h, i, j] = x


@overload(store_grad, target="generic")
def _store_grad(grad_t, b, h, i, j, x):
    if len(grad_t.types) == 0:
        return lambda grad_t, b, h, i, j, x: None

    def store(grad_t, b, h, i, j, x):
        grad_t[0][b, h, i, j] = x
    return store


@njit(**INLINE)
def tile_state(r, has_block_mask, bq, bk, b, h, i_first, i_last, j_first, j_last):
    """The block mask's state of the tile of rows ``i_first..i_last`` and keys
    ``j_first..j_last`` (inclusive): BLOCK_EMPTY if every block-mask block it overlaps is
    empty, BLOCK_FULL if every one is full (or without a block mask), else BLOCK_PARTIAL.
    ``bq``, ``bk``: the block mask's rows and keys per block (any sizes: the kernels' tiles
    need not match them). Device code."""
    if not has_block_mask:
        return BLOCK_FULL
    return covered_block_state(r, b, h, i_first, i_last, j_first, j_last, bq, bk)


@njit(**INLINE)
def tile_visit(r, has_block_mask, element_mask, bq, bk, b, h, i_first, i_last, j_first,
               j_last):
    """``(state, test)`` of the tile of rows ``i_first..i_last`` and keys ``j_first..j_last``
    (inclusive): its :func:`tile_state` (BLOCK_EMPTY: skipped), and whether its scores need
    the per-element tests (:func:`~sdpa_numba.score.recipe.keeps`): where the window cuts the
    tile, or a mask_mod (``element_mask``) may and the block mask does not say the tile is
    full. Device code."""
    state = tile_state(r, has_block_mask, bq, bk, b, h, i_first, i_last, j_first, j_last)
    test = not window_covers(r, i_first, i_last, j_first, j_last) or (
        element_mask and (not has_block_mask or state == BLOCK_PARTIAL))
    return state, test


@njit(**INLINE)
def sink_of(r, h):
    """Head ``h``'s sink logit, or -inf without sinks
    (:func:`~sdpa_numba.score.recipe.sink_logit`, callable from the simulator too)."""
    return sink_logit(r, h)


@njit(**INLINE)
def modifies(r):
    """Whether the recipe changes scores (:func:`~sdpa_numba.score.recipe.modifies_scores`,
    callable from the simulator too)."""
    return modifies_scores(r)
