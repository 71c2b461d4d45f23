"""The validated problem: :func:`plan` checks the operands' shapes, dtypes and flags and
returns a :class:`Plan`, which everything below the public functions reads (both back ends,
forward and backward).

Everything here works on shapes and dtypes alone (anything with ``shape``, ``ndim`` and a
NumPy ``dtype``: host or device arrays), so that the CPU and CUDA back ends share it.
"""

import math
from dataclasses import dataclass

import numpy as np

from .arguments import check_flag, check_scale, shape_str
from .dtypes import check_storage_dtype, compute_dtype
from .block_mask import with_block_mask
from .out import given_arrays
from .variants import variants_recipe
from ..score.recipe import DENSE, Recipe


@dataclass(frozen=True)
class Plan:
    """The problem after validation: how the operands map onto the kernels' 4-D layout.

    ``batch`` is the broadcast shape of the leading (batch) dims; every operand is seen as
    ``(*batch, heads, rows, cols)``. ``hq``/``h``: query and key/value heads (``h`` divides
    ``hq``; without GQA, ``h == hq`` after broadcasting). ``out_shape`` is the user-facing
    output shape; ``lse`` has ``out_shape[:-1]``.
    """

    batch: tuple
    hq: int
    h: int
    L: int
    S: int
    E: int
    Ev: int
    out_shape: tuple
    dtype: np.dtype
    compute_dtype: np.dtype
    scale: float
    is_causal: bool
    mask_kind: str  # "none", "bool" or "additive"
    #: The variants as the kernels read them (:mod:`sdpa_numba.score.recipe`): window (with
    #: causality folded into its right side), alignment, soft cap, ALiBi, sinks, the user's
    #: functions, block mask. DENSE / CAUSAL for plain calls.
    recipe: Recipe = DENSE
    #: The call's other arrays as given (ALiBi slopes, sinks, mod_args arrays, the block
    #: mask's states), ``(name, array)`` pairs that ``out`` must not overlap
    #: (:func:`sdpa_numba.problem.out.given_arrays`).
    given: tuple = ()


def _broadcast(shapes, names, what):
    """NumPy broadcasting of ``shapes``, with an error that names the arguments."""
    try:
        return tuple(np.broadcast_shapes(*shapes))
    except ValueError:
        desc = ", ".join(f"{n} {tuple(s)}" for n, s in zip(names, shapes))
        raise ValueError(f"{what} do not broadcast: {desc}") from None


#: Plans of plain calls (no variants) on NumPy arrays, by everything a plan depends on
#: (:func:`_plain_key`): a small call's host budget is tens of microseconds, and a model calls
#: with the same shapes again and again. Only plans that passed every check get in, so a bad
#: call still raises: the same key means the same checks on the same values.
_PLANS: dict = {}
#: Entries kept at most (then the cache starts over).
PLANS_KEPT = 256


def _plain_key(query, key, value, attn_mask, is_causal, scale, enable_gqa, backward):
    """The cache key of a plain call on NumPy arrays, or None if the call is not one.

    The flags must be Python bools and ``scale`` None or a nonzero Python float: an int 1 or
    a NumPy bool equals True (and would find True's plan, skipping the check that refuses
    it), and -0.0 equals 0.0 (whose plan has the other sign)."""
    if (type(query) is not np.ndarray or type(key) is not np.ndarray
            or type(value) is not np.ndarray or type(is_causal) is not bool
            or type(enable_gqa) is not bool
            or not (scale is None or (type(scale) is float and scale != 0.0))):
        return None
    if attn_mask is None:
        mask = None
    elif type(attn_mask) is np.ndarray:
        mask = (attn_mask.shape, attn_mask.dtype)
    else:
        return None
    return (query.shape, query.dtype, key.shape, key.dtype, value.shape, value.dtype, mask,
            is_causal, scale, enable_gqa, backward)


def plan(query, key, value, attn_mask, is_causal, scale, enable_gqa, *, backward=False,
         **variants):
    """Validate the arguments' shapes, dtypes and flags; return a :class:`Plan`.

    Works on anything with ``shape``, ``ndim`` and a NumPy ``dtype`` (host or device arrays).
    ``variants``: the keyword-only variants of the public functions (``window``,
    ``alignment``, ``softcap``, ``alibi_slopes``, ``sinks``, ``score_mod``, ``mask_mod``,
    ``mod_args``, ``score_mod_grad``, ``block_mask``), validated into ``Plan.recipe`` by
    :func:`sdpa_numba.problem.variants.variants_recipe`; ``backward``: the plan is the
    backward's.

    Plain calls on NumPy arrays (no variants) are planned once per set of shapes, dtypes and
    flags, then found in a cache (:data:`_PLANS`).
    """
    ck = None if variants else _plain_key(query, key, value, attn_mask, is_causal, scale,
                                          enable_gqa, backward)
    if ck is not None:
        p = _PLANS.get(ck)
        if p is not None:
            return p
    p = _plan(query, key, value, attn_mask, is_causal, scale, enable_gqa, backward, variants)
    if ck is not None:
        if len(_PLANS) >= PLANS_KEPT:
            _PLANS.clear()
        _PLANS[ck] = p
    return p


def _plan(query, key, value, attn_mask, is_causal, scale, enable_gqa, backward, variants):
    """:func:`plan` without its cache."""
    is_causal = check_flag("is_causal", is_causal)
    enable_gqa = check_flag("enable_gqa", enable_gqa)
    for name, x in (("query", query), ("key", key), ("value", value)):
        if x.ndim < 2:
            raise ValueError(f"{name} must have at least 2 dims (..., L, E), got shape "
                             f"{shape_str(x)}")
    dtype = check_storage_dtype("query", query)
    for name, x in (("key", key), ("value", value)):
        check_storage_dtype(name, x, ("query", dtype))

    L, E = query.shape[-2:]
    S, Ek = key.shape[-2:]
    Sv, Ev = value.shape[-2:]
    if Ek != E:
        raise ValueError(f"key's last dim must equal query's: query {shape_str(query)}, "
                         f"key {shape_str(key)}")
    if Sv != S:
        raise ValueError(f"value must have as many rows as key: key {shape_str(key)}, "
                         f"value {shape_str(value)}")

    nd = max(query.ndim, key.ndim, value.ndim, 3)
    qs, ks, vs = ((1,) * (nd - x.ndim) + tuple(x.shape) for x in (query, key, value))
    batch = _broadcast([qs[:-3], ks[:-3], vs[:-3]], ["query", "key", "value"],
                       "batch dims of query, key and value")
    hq, hk, hv = qs[-3], ks[-3], vs[-3]
    if hk != hv:
        raise ValueError(f"key and value must have the same number of heads: key "
                         f"{shape_str(key)}, value {shape_str(value)}")
    if enable_gqa:
        if hk == 0 or hq % hk:
            raise ValueError(f"enable_gqa needs query heads to be a multiple of key/value heads:"
                             f" query {shape_str(query)}, key {shape_str(key)}")
        h = hk
    else:
        (hq,) = _broadcast([(hq,), (hk,)], ["query", "key"],
                           "heads of query and key (pass enable_gqa=True for grouped-query "
                           "attention)")
        h = hq
    out_shape = (*batch, hq, L, Ev)
    # Sizes are products of Python ints here; in NumPy and in the kernels they are int64.
    for what, shape in (("output", out_shape), ("scores", (*batch, hq, L, S))):
        if math.prod(shape) * dtype.itemsize >= 2**63:
            raise ValueError(f"the {what} would have shape {shape}, too large to address: "
                             f"query {shape_str(query)}, key {shape_str(key)}, value "
                             f"{shape_str(value)}")
    if nd > max(query.ndim, key.ndim, value.ndim):  # 2-D inputs: no head dim in the output
        out_shape = out_shape[1:]

    mask_kind = "none"
    if attn_mask is not None:
        mdt = np.dtype(attn_mask.dtype)
        if mdt == np.bool_:
            mask_kind = "bool"
        elif mdt == dtype:
            mask_kind = "additive"
        else:
            raise TypeError(f"attn_mask dtype {mdt} must be bool or the query dtype {dtype}")
        scores = (*batch, hq, L, S)
        try:
            fits = np.broadcast_shapes(tuple(attn_mask.shape), scores) == scores
        except ValueError:
            fits = False
        if not fits:
            raise ValueError(f"attn_mask of shape {shape_str(attn_mask)} does not broadcast "
                             f"to the scores' shape {scores} (..., Hq, L, S)")

    scale = check_scale(scale, E)

    cdt = compute_dtype(dtype)
    r = with_block_mask(variants_recipe(batch, hq, L, S, cdt, is_causal, backward=backward,
                                        **variants), batch, hq, L, S)
    return Plan(batch, hq, h, L, S, E, Ev, out_shape, dtype, cdt, scale, is_causal, mask_kind,
                r, given_arrays(variants))
