"""How a score is formed: the one definition both targets compile.

A kernel receives the variants of a call as one :class:`Recipe`, a named tuple of run-time
numbers (the window in the aligned frame, the chunk size of chunked local attention, the soft
cap, the batch offset of the launch) and of
optional parts (ALiBi slopes, sinks, the user's ``score_mod``/``mask_mod``/``score_mod_grad``
and their ``mod_args``, a block mask). "Not used" is ``None`` for every optional part, and the
functions below are resolved by type at compile time, so an unused part costs nothing in the
compiled kernel. The numbers are run-time values: dense, causal, windowed, chunked, bottom-right and
soft-capped attention are one compiled specialization.

For query row ``i`` and key ``j`` (positions in the call's ``q`` and ``k``; ``b`` the flat batch
index, ``h`` the query head), with ``i' = i + offset`` the row in the aligned frame
(``offset = 0`` top-left, ``S - L`` bottom-right)::

    s = scale · q_i · k_j                      (the kernels form this)
    s = softcap · tanh(s / softcap)            if softcap > 0
    s = s - slope[b, h] · |i' - j|             if ALiBi slopes are given
    s = score_mod(s, b, h, i, j, *mod_args)    if given
    s = s + attn_mask[b, h, i, j]              (float masks: the kernels add it)
    s = -inf unless  i' - left <= j <= i' + right  (causal: right = 0)
               and  floor(i' / chunk) == floor(j / chunk)  if chunk > 0
               and mask_mod(b, h, i, j, *mod_args)  and the bool mask (the kernels' part)

The chunk rule is chunked local attention (Llama 4's ``attention_chunk``): the positions
``i'`` (the query's, in the aligned frame) and ``j`` (the key's) fall into chunks of
``chunk`` positions from position 0, and a query sees only the keys of its own chunk. A row
at a negative position (bottom-right alignment with ``L > S``) is in a chunk without keys.

Sinks do not change scores: each head's sink logit joins every row's softmax denominator
(:func:`fold_sink`). Work lists come from the window and the chunks alone (:func:`key_range`,
:func:`query_range`, :func:`window_covers`) and, when given, a block mask: every kernel that
reads them skips whole blocks outside a row's chunk.

All functions are ``@njit`` (inlined); numba-cuda compiles them as device functions, and the
type dispatch (``None`` or not) uses ``@overload(target="generic")``, which both targets see.
"""

import math
from collections import namedtuple

import numpy as np
from numba import njit, types
from numba.extending import overload

from ..options import FASTMATH, INLINE
from .blocks import BLOCK_EMPTY, BLOCK_FULL, BLOCK_PARTIAL
from .numbers import cast

#: A window side without a limit, in the kernels' encoding (``i' ± NO_LIMIT`` stays far inside
#: int64 for any row index).
NO_LIMIT = 1 << 62

Recipe = namedtuple("Recipe", [
    "offset",          # int64: i' = i + offset
    "left",            # int64: keys j >= i' - left are seen (NO_LIMIT: all)
    "right",           # int64: keys j <= i' + right are seen (0: causal; NO_LIMIT: all)
    "chunk",           # int64: > 0: keys j with j // chunk == i' // chunk are seen; 0: all
    "softcap",         # float64: > 0 caps scores; 0.0: no cap
    "batch_offset",    # int64: flat batch index of the launch's first batch entry
    "alibi",           # None or (B or 1, Hq) slopes, compute dtype
    "sinks",           # None or (Hq,) logits, compute dtype
    "score_mod",       # None or an @njit function (s, b, h, i, j, *mod_args) -> s
    "mask_mod",        # None or an @njit function (b, h, i, j, *mod_args) -> bool
    "score_mod_grad",  # None or an @njit function (s, b, h, i, j, *mod_args) -> ds'/ds
    "mod_args",        # tuple of arrays (or scalars), () when none
    "block_mask",      # None or int8 (B or 1, Hq or 1, q blocks, k blocks) of BLOCK_* states
                       # (.blocks: the block size)
])


#: The recipe's run-time numbers; every other part is optional (None when unused; ``()`` for
#: ``mod_args``).
NUMBERS = ("offset", "left", "right", "chunk", "softcap", "batch_offset")


def has_optional_parts(r):
    """Whether host recipe ``r`` has any optional part (arrays, functions, ``mod_args``): a
    recipe without one runs as plain (dense, causal, windowed, soft-capped) attention."""
    return len(r.mod_args) > 0 or any(x is not None for f, x in zip(r._fields, r)
                                      if f not in NUMBERS and f != "mod_args")


def recipe(*, offset=0, left=NO_LIMIT, right=NO_LIMIT, chunk=0, softcap=0.0, batch_offset=0,
           alibi=None, sinks=None, score_mod=None, mask_mod=None, score_mod_grad=None,
           mod_args=(), block_mask=None):
    """A :class:`Recipe` with the kernels' types; arguments are trusted (the public layer
    validates them).

    The defaults are plain attention; the numbers are always int64/float64, so that every
    recipe without optional parts has one Numba type. Callable from host code and, with the
    same keywords, from jitted code (``@njit`` and ``@cuda.jit``), where ``mod_args`` must be
    a tuple. Window sides are in the kernels' encoding: ``NO_LIMIT`` for unlimited, ``right``
    0 for causal; ``offset`` is ``S - L`` for bottom-right alignment, else 0; ``chunk`` 0 for
    no chunks.
    """
    return Recipe(np.int64(offset), np.int64(left), np.int64(right), np.int64(chunk),
                  np.float64(softcap), np.int64(batch_offset), alibi, sinks, score_mod,
                  mask_mod, score_mod_grad, tuple(mod_args), block_mask)


@overload(recipe, target="generic")
def _recipe(offset=0, left=NO_LIMIT, right=NO_LIMIT, chunk=0, softcap=0.0, batch_offset=0,
            alibi=None, sinks=None, score_mod=None, mask_mod=None, score_mod_grad=None,
            mod_args=(), block_mask=None):
    # The same keywords from jitted code (a user's @njit or @cuda.jit): the parts left out
    # are typed None, so they drop out of the kernels as the host recipe's do. ``mod_args``
    # must be a tuple there (jitted code has no tuple()).
    def impl(offset=0, left=NO_LIMIT, right=NO_LIMIT, chunk=0, softcap=0.0, batch_offset=0,
             alibi=None, sinks=None, score_mod=None, mask_mod=None, score_mod_grad=None,
             mod_args=(), block_mask=None):
        return Recipe(np.int64(offset), np.int64(left), np.int64(right), np.int64(chunk),
                      np.float64(softcap), np.int64(batch_offset), alibi, sinks, score_mod,
                      mask_mod,
                      score_mod_grad, mod_args, block_mask)
    return impl


def with_batch_offset(r, batch_offset):
    """``r`` for a launch whose first batch entry is ``batch_offset`` (host code)."""
    return r._replace(batch_offset=np.int64(batch_offset))


def absent(r, name):
    """Whether the Numba type of recipe ``r`` has no ``name`` part (typing code)."""
    return isinstance(r.types[r.fields.index(name)], types.NoneType)


#: The recipe of plain attention, and of plain causal attention (top-left).
DENSE = recipe()
CAUSAL = recipe(right=0)


def kernel_recipe(recipe, is_causal):
    """The recipe a kernel runs: ``recipe`` with ``is_causal`` folded into its right side (at
    most 0), or for None the plain recipe (top-left causal if ``is_causal``), so that the
    kernels' own API keeps taking ``is_causal`` alone (jitted code only)."""
    raise NotImplementedError("kernel_recipe is only callable from jitted code")


@overload(kernel_recipe, target="generic")
def _kernel_recipe(recipe, is_causal):
    if isinstance(recipe, (types.NoneType, types.Omitted)):
        def plain(recipe, is_causal):
            right = np.int64(0) if is_causal else np.int64(NO_LIMIT)
            return Recipe(np.int64(0), np.int64(NO_LIMIT), right, np.int64(0), 0.0,
                          np.int64(0), None, None, None, None, None, (), None)
        return plain

    def given(recipe, is_causal):
        r = recipe
        right = min(r.right, 0) if is_causal else r.right
        return Recipe(r.offset, r.left, right, r.chunk, r.softcap, r.batch_offset, r.alibi,
                      r.sinks, r.score_mod, r.mask_mod, r.score_mod_grad, r.mod_args, r.block_mask)
    return given


@njit(**INLINE)
def sequence_recipe(r, b, l_len, s_len, bottom_right):
    """Recipe ``r`` (a kernel's, see :func:`kernel_recipe`) for sequence ``b`` of a packed
    (varlen) batch of ``l_len`` query rows and ``s_len`` keys, in that sequence's own frame:
    rows and keys count from the sequence's first, the window is aligned per sequence
    (``offset = s_len - l_len`` if ``bottom_right``, else ``r``'s), and the functions see
    batch index ``b`` (added to ``r``'s batch offset: a kernel passes batch index 0 with it).
    """
    offset = s_len - l_len if bottom_right else r.offset
    return Recipe(np.int64(offset), r.left, r.right, r.chunk, r.softcap, r.batch_offset + b,
                  r.alibi,
                  r.sinks, r.score_mod, r.mask_mod, r.score_mod_grad, r.mod_args,
                  r.block_mask)


# --- the window and the chunks: which keys a row sees; work lists -----------------------------

@njit(**INLINE)
def in_window(r, i, j):
    """Whether query row ``i`` sees key ``j`` under the window (and causality) and the
    chunks."""
    ii = i + r.offset
    if r.chunk > 0 and ii // r.chunk != j // r.chunk:
        return False
    return j >= ii - r.left and j <= ii + r.right


@njit(**INLINE)
def key_range(r, i_first, i_last, s_len):
    """``(j_begin, j_end)``: the keys that any of rows ``i_first..i_last`` (inclusive) can see
    under the window and the chunks (from the first row's chunk to the last row's), within
    ``[0, s_len)``; ``(0, 0)`` when none. (Not an empty range at ``j_begin``: that may lie
    past the last key, and a loop over key blocks aligned down from it would read keys that
    do not exist.)"""
    j_begin = max(i_first + r.offset - r.left, 0)
    j_end = min(i_last + r.offset + r.right + 1, s_len)
    if r.chunk > 0:
        j_begin = max(j_begin, (i_first + r.offset) // r.chunk * r.chunk)
        j_end = min(j_end, ((i_last + r.offset) // r.chunk + 1) * r.chunk)
    if j_end <= j_begin:
        j_begin = j_end = 0
    return j_begin, j_end


@njit(**INLINE)
def query_range(r, j_first, j_last, l_len):
    """``(i_begin, i_end)``: the query rows that see any of keys ``j_first..j_last``
    (inclusive) under the window and the chunks, within ``[0, l_len)``. The
    inverse of :func:`key_range`, for work lists that go key block first (the backward):
    row ``i`` sees key ``j`` iff ``j - offset - right <= i <= j - offset + left`` (and, with
    chunks, ``i + offset`` lies in ``j``'s chunk); ``(0, 0)`` when none, as
    :func:`key_range`."""
    i_begin = max(j_first - r.offset - r.right, 0)
    i_end = min(j_last - r.offset + r.left + 1, l_len)
    if r.chunk > 0:
        i_begin = max(i_begin, j_first // r.chunk * r.chunk - r.offset)
        i_end = min(i_end, (j_last // r.chunk + 1) * r.chunk - r.offset)
    if i_end <= i_begin:
        i_begin = i_end = 0
    return i_begin, i_end


@njit(**INLINE)
def window_covers(r, i_first, i_last, j_first, j_last):
    """Whether every row ``i_first..i_last`` sees every key ``j_first..j_last`` under the
    window and the chunks (the tile needs no per-element window test)."""
    return ((j_first >= i_last + r.offset - r.left) and (j_last <= i_first + r.offset + r.right)
            and in_one_chunk(r, i_first, i_last, j_first, j_last))


@njit(**INLINE)
def in_one_chunk(r, i_first, i_last, j_first, j_last):
    """Whether rows ``i_first..i_last`` and keys ``j_first..j_last`` all lie in one chunk
    (always, without chunks): the chunk rule masks nothing in the tile, the window alone
    decides."""
    if r.chunk <= 0:
        return True
    c = (i_first + r.offset) // r.chunk
    return ((i_last + r.offset) // r.chunk == c and j_first // r.chunk == c
            and j_last // r.chunk == c)


def block_state(r, b, h, qb, kb):
    """The block mask's state of (query block ``qb``, key block ``kb``) of (``b``, ``h``):
    BLOCK_FULL without a block mask (jitted code only)."""
    raise NotImplementedError("block_state is only callable from jitted code")


@overload(block_state, target="generic", fastmath=FASTMATH)
def _block_state(r, b, h, qb, kb):
    if absent(r, "block_mask"):
        return lambda r, b, h, qb, kb: BLOCK_FULL
    # Broadcast over batch and heads by size-1 leading dims.
    return lambda r, b, h, qb, kb: r.block_mask[
        min(b + r.batch_offset, r.block_mask.shape[0] - 1), min(h, r.block_mask.shape[1] - 1),
        qb, kb]


@njit(**INLINE)
def covered_block_state(r, b, h, i_first, i_last, j_first, j_last, bq, bk):
    """The state of the tile of rows ``i_first..i_last`` and keys ``j_first..j_last``
    (inclusive) under the recipe's block mask of ``bq`` x ``bk`` blocks: BLOCK_EMPTY if every
    block it overlaps is empty, BLOCK_FULL if every one is full, else BLOCK_PARTIAL (the
    kernels' tiles need not match the block mask's blocks)."""
    n_empty = 0
    n_full = 0
    n = 0
    for qb in range(i_first // bq, i_last // bq + 1):
        for kb in range(j_first // bk, j_last // bk + 1):
            st = block_state(r, b, h, qb, kb)
            n += 1
            if st == BLOCK_EMPTY:
                n_empty += 1
            elif st == BLOCK_FULL:
                n_full += 1
    if n_empty == n:
        return BLOCK_EMPTY
    if n_full == n:
        return BLOCK_FULL
    return BLOCK_PARTIAL


# --- the score -----------------------------------------------------------------------------

@njit(**INLINE)
def soft_cap(s, c):
    """``c · tanh(s / c)`` (the caller checks ``c > 0``), in ``s``'s type."""
    c = cast(c, s)
    return c * math.tanh(s / c)


def alibi_bias(r, s, b, h, i, j):
    """``s - slope[b, h] · |i' - j|`` with ALiBi slopes, else ``s`` (jitted code only)."""
    raise NotImplementedError("alibi_bias is only callable from jitted code")


@overload(alibi_bias, target="generic", fastmath=FASTMATH)
def _alibi_bias(r, s, b, h, i, j):
    if absent(r, "alibi"):
        return lambda r, s, b, h, i, j: s
    # The distance cast first: a float32 slope times an int64 is float64 arithmetic in Numba.
    return lambda r, s, b, h, i, j: s - cast(
        r.alibi[min(b + r.batch_offset, r.alibi.shape[0] - 1), h], s) * cast(
            abs(i + r.offset - j), s)


def user_score(r, s, b, h, i, j):
    """``score_mod(s, b, h, i, j, *mod_args)`` (``b`` the flat batch index of the call), or
    ``s`` without one (jitted code only)."""
    raise NotImplementedError("user_score is only callable from jitted code")


@overload(user_score, target="generic", fastmath=FASTMATH)
def _user_score(r, s, b, h, i, j):
    if absent(r, "score_mod"):
        return lambda r, s, b, h, i, j: s
    return lambda r, s, b, h, i, j: r.score_mod(s, b + r.batch_offset, h, i, j, *r.mod_args)


def user_score_grad(r, s, b, h, i, j):
    """``score_mod_grad(s, b, h, i, j, *mod_args)``: d score_mod / d s at ``s``; 1 without a
    score_mod (jitted code only). The public layer refuses a backward with a score_mod and no
    score_mod_grad."""
    raise NotImplementedError("user_score_grad is only callable from jitted code")


@overload(user_score_grad, target="generic", fastmath=FASTMATH)
def _user_score_grad(r, s, b, h, i, j):
    if absent(r, "score_mod") or absent(r, "score_mod_grad"):
        return lambda r, s, b, h, i, j: cast(1.0, s)
    return lambda r, s, b, h, i, j: r.score_mod_grad(s, b + r.batch_offset, h, i, j,
                                                     *r.mod_args)


def user_keeps(r, b, h, i, j):
    """``mask_mod(b, h, i, j, *mod_args)``, or True without one (jitted code only)."""
    raise NotImplementedError("user_keeps is only callable from jitted code")


@overload(user_keeps, target="generic", fastmath=FASTMATH)
def _user_keeps(r, b, h, i, j):
    if absent(r, "mask_mod"):
        return lambda r, b, h, i, j: True
    return lambda r, b, h, i, j: r.mask_mod(b + r.batch_offset, h, i, j, *r.mod_args)


@njit(**INLINE)
def capped_score(r, s, b, h, i, j):
    """The score after the soft cap: from the (capped) ``s``, every change that follows it
    (ALiBi, score_mod, in that order; no masks). Kernels that soft-cap whole tiles at once
    apply it element by element after that, where :func:`modifies_capped` says it changes
    anything."""
    s = alibi_bias(r, s, b, h, i, j)
    return user_score(r, s, b, h, i, j)


@njit(**INLINE)
def modified_score(r, s, b, h, i, j):
    """The score of (``b``, ``h``, ``i``, ``j``) from the scaled ``s = scale · q_i · k_j``:
    soft cap, then :func:`capped_score` (no masks). ``b`` is the launch's batch index."""
    if r.softcap > 0:
        s = soft_cap(s, r.softcap)
    return capped_score(r, s, b, h, i, j)


@njit(**INLINE)
def score_slope(r, s, b, h, i, j):
    """d modified_score / d s at the scaled ``s`` (the backward's chain rule: ALiBi adds a
    constant; the soft cap's derivative is ``1 - tanh²``)."""
    g = cast(1.0, s)
    if r.softcap > 0:
        c = cast(r.softcap, s)
        t = math.tanh(s / c)
        g = cast(1.0, s) - t * t  # not 1 - t * t: int64 - float32 is float64 in Numba
        s = c * t
    s = alibi_bias(r, s, b, h, i, j)
    return g * user_score_grad(r, s, b, h, i, j)


@njit(**INLINE)
def score_and_slope(r, s, b, h, i, j):
    """``(modified_score(r, s, ...), score_slope(r, s, ...))`` with one tanh: the two values
    a backward needs per element (the soft cap's tanh is a scalar library call on the CPU,
    as costly as the rest of the element's work)."""
    g = cast(1.0, s)
    if r.softcap > 0:
        c = cast(r.softcap, s)
        t = math.tanh(s / c)
        g = cast(1.0, s) - t * t
        s = c * t
    s = alibi_bias(r, s, b, h, i, j)
    return user_score(r, s, b, h, i, j), g * user_score_grad(r, s, b, h, i, j)


@njit(**INLINE)
def keeps(r, b, h, i, j):
    """Whether key ``j`` takes part in row ``i``'s softmax by the recipe (window, causality,
    mask_mod); the kernels apply the user's ``attn_mask`` themselves."""
    return in_window(r, i, j) and user_keeps(r, b, h, i, j)


def has_element_mask(r):
    """Whether the recipe masks inside a tile beyond the window: a mask_mod (jitted code
    only; a compile-time constant)."""
    raise NotImplementedError("has_element_mask is only callable from jitted code")


@overload(has_element_mask, target="generic")
def _has_element_mask(r):
    const = not absent(r, "mask_mod")
    return lambda r: const


def modifies_scores(r):
    """Whether the recipe changes scores (soft cap, ALiBi, score_mod): a run-time test of the
    soft cap and a compile-time one of the rest (jitted code only)."""
    raise NotImplementedError("modifies_scores is only callable from jitted code")


@overload(modifies_scores, target="generic")
def _modifies_scores(r):
    return lambda r: modifies_capped(r) or r.softcap > 0


def modifies_capped(r):
    """Whether :func:`capped_score` changes scores (ALiBi, a score_mod): a compile-time
    constant (jitted code only)."""
    raise NotImplementedError("modifies_capped is only callable from jitted code")


@overload(modifies_capped, target="generic")
def _modifies_capped(r):
    const = not (absent(r, "alibi") and absent(r, "score_mod"))
    return lambda r: const


# --- sinks ---------------------------------------------------------------------------------

def sink_logit(r, h):
    """Head ``h``'s sink logit, or -inf without sinks (jitted code only)."""
    raise NotImplementedError("sink_logit is only callable from jitted code")


@overload(sink_logit, target="generic", fastmath=FASTMATH)
def _sink_logit(r, h):
    if absent(r, "sinks"):
        return lambda r, h: -np.inf
    return lambda r, h: r.sinks[h]


@njit(**INLINE)
def fold_sink(m, l, sink):
    """Fold a sink logit into a row's final softmax state (max ``m``, sum ``l`` against it).

    Returns ``(m_new, l_new, alpha)``: the accumulator is to be multiplied by ``alpha``.
    Without a sink (``sink == -inf``) nothing changes; a row with every key masked (``l == 0``)
    gets ``l = 1`` against ``m = sink``: output 0, lse = sink.
    """
    if sink == -np.inf:
        return m, l, cast(1.0, l)
    sink = cast(sink, l)
    m_new = max(m, sink)
    alpha = math.exp(m - m_new) if l > 0 else cast(0.0, l)
    return m_new, alpha * l + math.exp(sink - m_new), alpha
