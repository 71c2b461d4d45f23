"""The score recipe (:mod:`sdpa_numba.score.recipe`) on the GPU: one kernel argument and back.

A CUDA kernel cannot take None or a function as an argument. So a host
:class:`~sdpa_numba.score.recipe.Recipe` travels as one :class:`RecipeArg`, a named tuple of

* six run-time numbers (offset, left, right, chunk, softcap, batch offset): dense, causal,
  windowed, chunked, bottom-right and soft-capped attention share one compiled kernel;
* each optional array (ALiBi slopes, sinks, block mask) as a tuple of zero or one array, and the
  block mask's block sizes as two more numbers; ``mod_args`` as the tuple it is (an empty tuple
  is no kernel argument at all);

while the user's functions (``score_mod``, ``mask_mod``, ``score_mod_grad``) are closed over by
the kernel factory, which is cached per :func:`compile_key`. Numba passes a named tuple as its
fields, so the kernel's parameters are the same as if each were its own.
:func:`recipe_of` rebuilds the Recipe inside the kernel, so that the kernels call the same
jitted score functions as the CPU; a kernel that takes the fields as parameters of its own
(``*kernel_args(r)``) rebuilds it with :func:`unpack`. The attention mask travels the same way
(:func:`masked`): an empty tuple is "no mask", the one encoding of it (no operand stands in for
it); the backward's mask gradient likewise (:func:`store_grad`).

On Numba's CUDA simulator the kernels run as Python and call the score functions as CPU-jitted
code, which cannot take the simulator's arrays: :func:`unpack` hands them their NumPy arrays.
"""

from collections import namedtuple

import numba
import numpy as np
from numba import njit, types
from numba.extending import overload

from ..options import INLINE
from ..score.recipe import BLOCK_FULL, BLOCK_PARTIAL, Recipe, covered_block_state, \
    modifies_scores, sink_logit, window_covers
from .storage import load

__all__ = ["RecipeArg", "compile_key", "arg_type", "kernel_args", "recipe_of", "unpack",
           "copy_to_device", "device_recipe", "masked", "store_grad", "tile_state", "tile_visit",
           "sink_of", "modifies", "NO_MASK"]

#: The attention-mask argument of a kernel without a mask.
NO_MASK = ()

#: A host recipe as one kernel argument (see the module doc; :func:`kernel_args`).
RecipeArg = namedtuple("RecipeArg", [
    "offset", "left", "right", "chunk", "softcap", "batch_offset",  # the recipe's numbers
    "alibi", "sinks", "block_mask",  # () or (array,) each
    "bq", "bk",  # the block mask's query rows and keys per block
    "mod_args",  # the tuple of mod_args
])


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
    """What of recipe ``r`` a compiled kernel depends on (hashable): which optional arrays are
    present, the user's functions (by identity) and the types of ``mod_args``."""
    return (r.alibi is not None, r.sinks is not None, r.block_mask is not None, r.score_mod,
            r.mask_mod, r.score_mod_grad, tuple(_type_of(x) for x in r.mod_args))


def arg_type(key, ct):
    """The Numba type of :func:`kernel_args` for compile key ``key`` and compute type ``ct``:
    a named tuple of :class:`RecipeArg`."""
    has_alibi, has_sinks, has_bm = key[:3]

    def opt(present, t):
        return types.UniTuple(t, 1) if present else types.Tuple(())

    return types.NamedTuple(
        (types.int64, types.int64, types.int64, types.int64, types.float64, types.int64,
         opt(has_alibi, types.Array(ct, 2, "A")), opt(has_sinks, types.Array(ct, 1, "A")),
         opt(has_bm, types.Array(types.int8, 3 + 1, "A")), types.int64, types.int64,
         types.Tuple(key[6])), RecipeArg)


def _device(x, to_device):
    return to_device(x) if isinstance(x, np.ndarray) else x


def kernel_args(r, block_sizes=(1, 1), to_device=None):
    """The kernel argument of host recipe ``r``: a :class:`RecipeArg` (see the module doc), of
    :func:`arg_type`'s type. ``block_sizes``: the block mask's (query rows, keys) per block.
    ``to_device``: copies NumPy arrays (slopes, sinks, block mask, ``mod_args``) to the
    device (default :func:`numba.cuda.to_device`)."""
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
    return RecipeArg(np.int64(r.offset), np.int64(r.left), np.int64(r.right),
                     np.int64(r.chunk), float(r.softcap), np.int64(r.batch_offset), opt(r.alibi), opt(r.sinks), opt(r.block_mask),
                     np.int64(block_sizes[0]), np.int64(block_sizes[1]), mod_args)


def copy_to_device(r):
    """Recipe ``r`` with its NumPy arrays (any optional part: slopes, sinks, block mask; and
    ``mod_args``) copied to the device: a launcher's, once per call rather than once per
    launch."""
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


def unpack(offset, left, right, chunk, softcap, batch_offset, alibi_t, sinks_t, bm_t,
           score_mod, mask_mod, score_mod_grad, mod_args):
    """The :class:`~sdpa_numba.score.recipe.Recipe` of a kernel's arguments (see the module
    doc); the functions are the kernel factory's. Device code (and simulator Python)."""
    return Recipe(offset, left, right, chunk, softcap, batch_offset,
                  _host(alibi_t[0]) if alibi_t else None, _host(sinks_t[0]) if sinks_t else None,
                  score_mod, mask_mod, score_mod_grad, tuple(_host(x) for x in mod_args),
                  _host(bm_t[0]) if bm_t else None)


@overload(unpack, target="generic")
def _unpack(offset, left, right, chunk, softcap, batch_offset, alibi_t, sinks_t, bm_t,
            score_mod, mask_mod, score_mod_grad, mod_args):
    # Resolved by type: an absent part is None in the recipe, so the score functions drop it
    # at compile time.
    has_alibi, has_sinks, has_bm = (len(t.types) > 0 for t in (alibi_t, sinks_t, bm_t))
    # Branches on constants are not pruned before typing: one implementation per case.
    a = "alibi_t[0]" if has_alibi else "None"
    s = "sinks_t[0]" if has_sinks else "None"
    m = "bm_t[0]" if has_bm else "None"
    src = (f"def impl(offset, left, right, chunk, softcap, batch_offset, alibi_t, sinks_t, "
           f"bm_t, score_mod, mask_mod, score_mod_grad, mod_args):\n"
           f"    return Recipe(offset, left, right, chunk, softcap, batch_offset, {a}, {s}, "
           f"score_mod, mask_mod, score_mod_grad, mod_args, {m})\n")
    ns = {"Recipe": Recipe}
    exec(src, ns)  # noqa: S102 - fixed source, chosen among eight by type
    return ns["impl"]


def recipe_of(ra, offset, score_mod, mask_mod, score_mod_grad):
    """The :class:`~sdpa_numba.score.recipe.Recipe` of kernel argument ``ra`` (a
    :class:`RecipeArg`) at ``offset`` (the work item's: per sequence in a packed batch); the
    functions are the kernel factory's. Device code (and simulator Python)."""
    return unpack(offset, ra.left, ra.right, ra.chunk, ra.softcap, ra.batch_offset, ra.alibi,
                  ra.sinks, ra.block_mask, score_mod, mask_mod, score_mod_grad, ra.mod_args)


@overload(recipe_of, target="generic")
def _recipe_of(ra, offset, score_mod, mask_mod, score_mod_grad):
    def impl(ra, offset, score_mod, mask_mod, score_mod_grad):
        return unpack(offset, ra.left, ra.right, ra.chunk, ra.softcap, ra.batch_offset,
                      ra.alibi, ra.sinks, ra.block_mask, score_mod, mask_mod, score_mod_grad,
                      ra.mod_args)
    return impl


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
