"""The attention variants' arguments, validated into the kernels' :class:`~sdpa_numba.score.recipe.Recipe`.

One function, :func:`variants_recipe`, called by :func:`~sdpa_numba.problem.plan`: it checks
the variants of :data:`~.variant_table.VARIANTS` (TypeError / ValueError naming the argument,
before any kernel runs) and encodes them once, as the recipe both targets and both directions
read (:mod:`sdpa_numba.score.recipe`): the per-head arrays through the table's checks, the
window, alignment, soft cap, the user's functions and the block mask here (they depend on each
other and on causality). Plain calls get the shared :data:`~sdpa_numba.score.recipe.DENSE` /
:data:`~sdpa_numba.score.recipe.CAUSAL` recipes.

Small arrays (ALiBi slopes, sinks) become host NumPy arrays in the compute dtype; a GPU
launcher copies them to the device.
"""

import inspect
import math
import numbers

import numpy as np

from ..score import recipe as R
from ..score.blocks import K_BLOCK, Q_BLOCK, BlockMask, block_counts
from .variant_table import BY_NAME, PER_HEAD, is_default

_ALIGNMENTS = ("top_left", "bottom_right")


def _side(name, x):
    """A window side: a non-negative int, or None (unlimited) as NO_LIMIT."""
    if x is None:
        return R.NO_LIMIT
    if isinstance(x, (bool, np.bool_)) or not isinstance(x, numbers.Integral):
        raise TypeError(f"window's {name} side must be an int >= 0 or None, got "
                        f"{type(x).__name__}")
    x = int(x)
    if x < 0:
        raise ValueError(f"window's {name} side must be >= 0 (or None: unlimited), got {x}")
    return min(x, R.NO_LIMIT)


def check_window(window):
    """``window`` as ``(left, right)`` in the kernels' encoding (NO_LIMIT for unlimited)."""
    if window is None:
        return R.NO_LIMIT, R.NO_LIMIT
    if isinstance(window, (str, bytes)) or not hasattr(window, "__len__") or len(window) != 2:
        raise TypeError(f"window must be None or a pair (left, right) of ints >= 0 or None, "
                        f"got {window!r}")
    return _side("left", window[0]), _side("right", window[1])


def check_alignment(alignment):
    """``alignment`` as given: "top_left" or "bottom_right"."""
    if not isinstance(alignment, str):
        raise TypeError(f"alignment must be 'top_left' or 'bottom_right', got "
                        f"{type(alignment).__name__}")
    if alignment not in _ALIGNMENTS:
        raise ValueError(f"alignment must be 'top_left' or 'bottom_right', got {alignment!r}")
    return alignment


def check_chunk(chunk):
    """``chunk`` (chunked local attention: a query sees only the keys of its own chunk of
    ``chunk`` positions) as the kernels' int, or 0 for None (no chunks)."""
    if chunk is None:
        return 0
    if isinstance(chunk, (bool, np.bool_)) or not isinstance(chunk, numbers.Integral):
        raise TypeError(f"chunk must be an int >= 1 or None, got {type(chunk).__name__}")
    c = int(chunk)
    if c < 1:
        raise ValueError(f"chunk must be >= 1 (or None: no chunks), got {c}")
    # A chunk past any position is one chunk from position 0 (and keeps the kernels' chunk
    # bounds inside int64).
    return min(c, R.NO_LIMIT)


def check_softcap(softcap, cdt=np.float64):
    """``softcap`` as a float > 0, or 0.0 for None (no cap). The kernels divide scores by it
    (they fold ``1 / softcap`` into the queries' scale): a cap whose reciprocal overflows the
    compute dtype ``cdt`` would turn every score into inf or NaN, so it is refused."""
    if softcap is None:
        return 0.0
    if isinstance(softcap, (bool, np.bool_)) or not isinstance(softcap, numbers.Real):
        raise TypeError(f"softcap must be a real number > 0 or None, got "
                        f"{type(softcap).__name__}")
    c = float(softcap)
    if not (math.isfinite(c) and c > 0):
        raise ValueError(f"softcap must be finite and > 0, got {softcap}")
    if 1 / c > float(np.finfo(cdt).max):
        raise ValueError(f"softcap {softcap} is too small for the compute dtype "
                         f"{np.dtype(cdt)}: 1 / softcap overflows it (softcap must be at "
                         f"least {1 / float(np.finfo(cdt).max):.3g})")
    return c


def check_mod_args(mod_args):
    """``mod_args`` as a tuple, each entry typed by Numba (arrays, numbers)."""
    from numba import typeof

    if mod_args is None:
        return ()
    if not isinstance(mod_args, (tuple, list)):
        raise TypeError(f"mod_args must be a tuple of arrays or numbers, got "
                        f"{type(mod_args).__name__}")
    for n, x in enumerate(mod_args):
        try:
            typeof(x)
        except (ValueError, TypeError):
            raise TypeError(f"mod_args[{n}] has a type Numba cannot pass to a jitted function: "
                            f"{type(x).__name__} (use NumPy arrays and numbers)") from None
    return tuple(mod_args)


def _arity_fits(py_func, n):
    """Whether ``py_func`` can be called with ``n`` positional arguments."""
    try:
        params = inspect.signature(py_func).parameters.values()
    except (TypeError, ValueError):
        return True  # no signature to read: compiling it will tell
    pos = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    required = [p for p in pos if p.default is p.empty]
    if any(p.kind == p.VAR_POSITIONAL for p in params):
        return len(required) <= n
    return len(required) <= n <= len(pos)


def check_function(name, f, kind, mod_args, cdt):
    """A user's ``score_mod`` / ``score_mod_grad`` (``kind`` "score") or ``mask_mod``
    ("mask"): a Numba CPU dispatcher of the right arity that compiles for the kernels'
    argument types and returns a float (score) or a bool (mask)."""
    from numba import from_dtype, typeof, types
    from numba.core.registry import CPUDispatcher, cpu_target

    if f is None:
        return None
    if not isinstance(f, CPUDispatcher):
        raise TypeError(f"{name} must be a Numba @njit function (a CPU dispatcher), got "
                        f"{type(f).__name__}")
    fixed = 5 if kind == "score" else 4
    sig = ("(score, b, h, i, j" if kind == "score" else "(b, h, i, j") + \
        "".join(f", mod_args[{n}]" for n in range(len(mod_args))) + ")"
    n_args = fixed + len(mod_args)
    if not _arity_fits(f.py_func, n_args):
        raise TypeError(f"{name} must take {n_args} arguments {sig}: "
                        f"{f.py_func.__name__}{inspect.signature(f.py_func)} does not")
    argtypes = ((from_dtype(cdt),) if kind == "score" else ()) + (types.int64,) * 4 + \
        tuple(typeof(x) for x in mod_args)
    try:  # typing it as a call from jitted code compiles it (and handles *args)
        ret = cpu_target.typing_context.resolve_function_type(
            types.Dispatcher(f), argtypes, {}).return_type
    except Exception as e:  # noqa: BLE001 - Numba's typing errors have many classes
        raise TypeError(f"{name} does not compile for the arguments {sig} typed "
                        f"{argtypes}: {type(e).__name__}: {e}") from None
    if kind == "score" and not isinstance(ret, types.Float):
        raise TypeError(f"{name} must return a float score, but returns {ret} for "
                        f"arguments {argtypes}")
    if kind == "mask" and not isinstance(ret, types.Boolean):
        raise TypeError(f"{name} must return a bool (True: the key takes part), but returns "
                        f"{ret} for arguments {argtypes}")
    return f


def _block_mask(block_mask, mask_mod, batch, hq, L, S):
    """The BlockMask's states array checked against the problem, and the mask_mod to use."""
    if block_mask is None:
        return None, mask_mod
    if not isinstance(block_mask, BlockMask):
        raise TypeError(f"block_mask must be a sdpa_numba.BlockMask (from "
                        f"sdpa_numba.create_block_mask), got {type(block_mask).__name__}")
    if mask_mod is None:
        mask_mod = block_mask.mask_mod
    elif mask_mod is not block_mask.mask_mod:
        raise ValueError("block_mask was made for another mask_mod than the one given: pass "
                         "the same function (or omit mask_mod to use the block mask's)")
    if (block_mask.q_block, block_mask.k_block) != (Q_BLOCK, K_BLOCK):
        raise ValueError(f"block_mask has blocks of {block_mask.q_block} x "
                         f"{block_mask.k_block}; the kernels read blocks of {Q_BLOCK} x "
                         f"{K_BLOCK} (make it with sdpa_numba.create_block_mask)")
    b_flat = math.prod(batch)
    st = block_mask.states
    want = block_counts(L, S)
    if (st.shape[2:] != want or block_mask.L != L or block_mask.S != S
            or st.shape[0] not in (1, b_flat) or st.shape[1] not in (1, hq)):
        raise ValueError(f"block_mask was made for (B, H, L, S) = ({block_mask.B}, "
                         f"{block_mask.H}, {block_mask.L}, {block_mask.S}); this call needs "
                         f"B 1 or {b_flat} (the batch flattened), H 1 or {hq}, L {L}, S {S}")
    return st, mask_mod


def is_plain(r):
    """Whether recipe ``r`` is dense or causal (top-left) attention: what the kernels did
    before the variants (a launcher that cannot run variants refuses the others)."""
    return (not R.has_optional_parts(r) and r.softcap == 0 and r.left == R.NO_LIMIT
            and r.chunk == 0
            and (r.right == R.NO_LIMIT or (r.right == 0 and r.offset == 0)))


def variants_recipe(batch, hq, L, S, cdt, is_causal, *, backward=False, **variants):
    """Validate the variants of a call and return its host :class:`Recipe`.

    ``batch``, ``hq``, ``L``, ``S``: the plan's batch shape, query heads and lengths; ``cdt``
    the compute dtype; ``variants``: keywords of :data:`~.variant_table.VARIANTS` (those
    left out take the table's defaults); ``backward``: the call is the backward (a score_mod
    needs its score_mod_grad; the forward's recipe leaves score_mod_grad out, so that it does
    not make another compiled specialization).
    """
    for name, x in variants.items():
        if name not in BY_NAME:
            raise TypeError(f"unexpected keyword argument {name!r} (not an attention variant)")
    if all(is_default(name, x) for name, x in variants.items()):  # the common case, cheaply
        return R.CAUSAL if is_causal else R.DENSE
    get = variants.get
    left, right = check_window(get("window"))
    chunk = check_chunk(get("chunk"))
    alignment = check_alignment(get("alignment", "top_left"))
    if is_causal:
        right = min(right, 0)
    offset = S - L if alignment == "bottom_right" else 0
    cap = check_softcap(get("softcap"), cdt)
    arrays = {v.field: v.check(get(v.name), batch, hq, cdt) for v in PER_HEAD
              if get(v.name) is not None}
    mod_args = check_mod_args(get("mod_args", ()))
    states, mask_mod = _block_mask(get("block_mask"), get("mask_mod"), batch, hq, L, S)
    score_mod = check_function("score_mod", get("score_mod"), "score", mod_args, cdt)
    mask_mod = check_function("mask_mod", mask_mod, "mask", mod_args, cdt)
    score_mod_grad = check_function("score_mod_grad", get("score_mod_grad"), "score", mod_args,
                                    cdt)
    if score_mod_grad is not None and score_mod is None:
        raise ValueError("score_mod_grad is given without a score_mod")
    if mod_args and score_mod is None and mask_mod is None:
        raise ValueError("mod_args are given without a score_mod or mask_mod to receive them")
    if backward and score_mod is not None and score_mod_grad is None:
        raise ValueError("the backward of a score_mod needs score_mod_grad(score, b, h, i, j, "
                         "*mod_args): d score_mod / d score")
    if not backward:
        score_mod_grad = None
    return R.recipe(offset=offset, left=left, right=right, chunk=chunk, softcap=cap, score_mod=score_mod,
                    mask_mod=mask_mod, score_mod_grad=score_mod_grad, mod_args=mod_args,
                    block_mask=states, **arrays)
