"""The attention variants, each described once: the table every layer derives its handling from.

Each :class:`Variant` says what a keyword of the public functions is and how it travels:

* its name, default and kind (``window``, ``int``, ``choice``, ``number``, ``per_head`` array,
  ``function``, ``args``, ``block_mask``);
* how it enters the kernels' :class:`~sdpa_numba.score.recipe.Recipe`: a ``per_head`` array
  through its ``check`` into its recipe ``field`` (:func:`~.variants.variants_recipe` does the
  rest, where variants depend on each other: the window and causality, a block mask and its
  ``mask_mod``);
* whether it may hold arrays the call reads (``out`` must not overlap them), whether ring
  attention shards it, whether the KV-cache functions take it, which targets' kernels run it
  (elsewhere a call that gives it raises NotImplementedError);
* how the torch operators carry it (``torch``: two ``int?`` sides for the window, an ``int?``,
  a ``str``, a ``float?``, a ``Tensor?``, or nothing: Numba functions cannot cross an operator's schema),
  how their vmap rule folds a batched tensor (``vmap``: ``"batch"``, its leading dims
  broadcast against the scores' batch dims so the vmapped dim folds into them, or ``"loop"``,
  one call per vmapped index), and how the double backward forms the score in torch
  operations (``torch_score``);
* its gradient, when it has one (``grad``: from the recipe and the forward's ``grad_out``,
  ``out`` and ``lse``; the backward returns it last).

The public functions (:mod:`sdpa_numba.api`, :mod:`~sdpa_numba.backward`,
:mod:`~sdpa_numba.varlen`, :mod:`~sdpa_numba.kvcache`) take the variants as ``**variants``
with the signature :func:`keyword_signature` gives them; the distributed call, the torch
operators' schemas, fake kernels, autograd and vmap rules read the table.

A new per-head array variant is an entry here (with its check), its recipe field and its
place in the score (:mod:`sdpa_numba.score.recipe`), its line in the float64 reference
(:mod:`sdpa_numba.reference`) and in :class:`sdpa_numba._typing.Variants`, a test and a line
of the documentation. The kernels ask the seam whether a recipe changes scores
(``modifies_scores``, ``modifies_capped``) and apply its functions, so none of them learns of
a new variant.
"""

import inspect
import numbers
from dataclasses import dataclass
from typing import Any, Callable, TypeVar

import numpy as np

from .arguments import shape_str


@dataclass(frozen=True)
class Variant:
    """One attention variant (see the module doc)."""

    name: str
    default: Any
    kind: str
    #: ``per_head``: the recipe field it fills and ``check(value, batch, hq, cdt)``, which
    #: validates it (naming it) and returns the field's array (None when absent).
    field: str | None = None
    check: Callable | None = None
    #: May hold arrays the call reads (``out`` must not overlap them).
    array: bool = False
    #: Ring attention shards it (else refuses it unless left at its default).
    ring: bool = False
    #: The KV-cache functions take it.
    kvcache: bool = True
    #: The targets whose kernels run it (:mod:`sdpa_numba.targets` names); on another, a call
    #: that gives it raises NotImplementedError.
    targets: tuple = ("host", "cuda")
    #: How the torch operators carry it: "window", "int", "str", "float", "tensor" or None.
    torch: str | None = None
    #: A "tensor"'s vmap rule: "batch" or "loop".
    vmap: str | None = None
    #: ``grad(recipe, grad_out, out, lse)``: d loss / d variant (float64 NumPy), or None.
    grad: Callable | None = None
    #: ``torch_score(s, value, rel)``: the score after this variant in torch operations
    #: (``rel`` = i' - j), for the double backward; None for variants that do not change
    #: scores there.
    torch_score: Callable | None = None


# --- the per-head arrays' checks and gradients ------------------------------------------

def host_array(name, x):
    """A small operand as a host NumPy array (a CUDA array is copied to the host)."""
    if hasattr(x, "__cuda_array_interface__") or hasattr(x, "copy_to_host"):
        if hasattr(x, "copy_to_host"):
            return x.copy_to_host()
        from numba import cuda

        return cuda.as_cuda_array(x).copy_to_host()
    if isinstance(x, (numbers.Number, str, bytes)) or x is None:
        raise TypeError(f"{name} must be an array, got {type(x).__name__}")
    try:
        a = np.asarray(x)
    except Exception as e:  # noqa: BLE001 - any conversion failure is the caller's type
        raise TypeError(f"{name} must be an array, got {type(x).__name__}: {e}") from None
    if a.dtype == object:
        raise TypeError(f"{name} must be a numeric array, got {type(x).__name__}")
    return a


def _kernel_array(a, cdt):
    """``a`` as the kernels take a per-head array: C-contiguous, of the compute dtype and
    writeable (a read-only view of the caller's array is copied). Writeability is part of a
    Numba array's type: read-only slopes compiled a second specialization of every kernel
    (measured: the ring tests' ALiBi cases, ~25 s each cold); the kernels never write them."""
    out = np.ascontiguousarray(a, dtype=cdt)
    return out if out.flags.writeable else out.copy()


def _float_array(name, x):
    a = host_array(name, x)
    if a.dtype not in (np.float32, np.float64):
        raise TypeError(f"{name} must be float32 or float64, got dtype {a.dtype}")
    return a


def check_alibi(alibi_slopes, batch, hq, cdt):
    """ALiBi slopes as the kernels' (B_flat or 1, Hq) array of the compute dtype, or None."""
    if alibi_slopes is None:
        return None
    a = _float_array("alibi_slopes", alibi_slopes)
    want = (*batch, hq)
    ok = a.ndim >= 1 and a.ndim <= len(want) and a.shape[-1] == hq
    if ok:
        try:
            ok = np.broadcast_shapes(a.shape, want) == want
        except ValueError:
            ok = False
    if not ok:
        raise ValueError(f"alibi_slopes of shape {shape_str(a)} must have shape (Hq,) = "
                         f"({hq},) or batch dims broadcastable to the scores' {want}")
    if not np.all(np.isfinite(a)):
        raise ValueError("alibi_slopes must be finite")
    if all(n == 1 for n in a.shape[:-1]):
        flat = a.reshape(1, hq)
    else:
        flat = np.broadcast_to(a, want).reshape(-1, hq)
    return _kernel_array(flat, cdt)


def check_sinks(sinks, hq, cdt):
    """Sink logits as the kernels' (Hq,) array of the compute dtype, or None."""
    if sinks is None:
        return None
    a = _float_array("sinks", sinks)
    if a.shape != (hq,):
        raise ValueError(f"sinks of shape {shape_str(a)} must have shape (Hq,) = ({hq},)")
    if np.any(np.isnan(a)) or np.any(a == np.inf):
        raise ValueError("sinks must be finite or -inf (no sink for that head)")
    return _kernel_array(a, cdt)



def sinks_grad(r, grad_out, out, lse):
    """d loss / d sinks, ``(Hq,)`` float64, from NumPy arrays of the plan's shapes.

    ``d sink_h = -Σ_{b,i} exp(sink_h - lse_{b,h,i}) · D_{b,h,i}``, ``D = rowsum(dO ∘ O)``
    (the sink's probability in each row times the row's ``-D``: the sink has no value row),
    accumulated in float64. A head without a sink (``-inf``) gets 0.
    """
    hq = r.sinks.shape[0]
    do = np.asarray(grad_out, np.float64)
    o = np.asarray(out, np.float64)
    d = np.einsum("...e,...e->...", do, o).reshape(-1, hq, np.shape(lse)[-1])
    lse64 = np.asarray(lse, np.float64).reshape(d.shape)
    sink = r.sinks.astype(np.float64)[None, :, None]
    with np.errstate(invalid="ignore", over="ignore"):
        w = np.where(np.isneginf(sink), 0.0, np.exp(sink - lse64))
    return -(w * d).sum(axis=(0, 2))


# --- the table ------------------------------------------------------------------------------

def _softcap_score(s, c, rel):
    import torch

    return c * torch.tanh(s / c)


def _alibi_score(s, slopes, rel):
    return s - slopes.to(s.dtype)[..., None, None] * rel.abs().to(s.dtype)


#: Every variant, in the order of the score's formula (the public signatures' order), then
#: those added later (the operators' schemas take them positionally).
VARIANTS = (
    Variant("window", None, "window", ring=True, torch="window"),
    Variant("alignment", "top_left", "choice", ring=True, torch="str"),
    Variant("softcap", None, "number", ring=True, torch="float", torch_score=_softcap_score),
    Variant("alibi_slopes", None, "per_head", field="alibi",
            check=check_alibi, array=True, ring=True, torch="tensor", vmap="batch",
            torch_score=_alibi_score),
    Variant("sinks", None, "per_head", field="sinks",
            check=lambda x, batch, hq, cdt: check_sinks(x, hq, cdt), array=True, ring=True,
            torch="tensor", vmap="loop", grad=sinks_grad),
    Variant("score_mod", None, "function"),
    Variant("mask_mod", None, "function"),
    Variant("mod_args", (), "args", array=True),
    Variant("score_mod_grad", None, "function", kvcache=False),
    Variant("block_mask", None, "block_mask", array=True),
    # Chunked local attention (a run-time number of the recipe: no compiled specialization).
    # Last, so that the torch operators' schemas keep their earlier arguments' positions.
    # Ring attention's steps split the keys by the window alone: it refuses chunks.
    Variant("chunk", None, "int", torch="int"),
)

BY_NAME = {v.name: v for v in VARIANTS}
NAMES = tuple(BY_NAME)
#: The per-head arrays: validated by their ``check`` into their recipe ``field``.
PER_HEAD = tuple(v for v in VARIANTS if v.kind == "per_head")
#: The variants that have a gradient (returned last by the backward, in this order).
WITH_GRAD = tuple(v for v in VARIANTS if v.grad is not None)
#: The variants' arguments that may hold arrays.
ARRAYS = tuple(v.name for v in VARIANTS if v.array)
#: The variants ring attention shards, and those it refuses unless off.
RING_SHARDED = tuple(v.name for v in VARIANTS if v.ring)
RING_REFUSED = tuple(v.name for v in VARIANTS if not v.ring)
#: The variants the torch operators take as tensors, and those no operator schema carries.
TORCH_TENSORS = tuple(v for v in VARIANTS if v.torch == "tensor")
NUMBA_LEVEL = tuple(v.name for v in VARIANTS if v.torch is None)


def is_default(name, x):
    """Whether ``x`` is variant ``name``'s default (None, its string; an empty tuple or None
    for ``mod_args``)."""
    d = BY_NAME[name].default
    if x is None:
        return d is None or d == ()
    if d is None:
        return False
    if isinstance(d, str):
        return isinstance(x, str) and x == d
    return isinstance(x, (tuple, list)) and len(x) == 0


def check_names(func, variants, exclude=(), target=None):
    """TypeError naming the keyword when ``variants`` (a dict) holds one that ``func`` (its
    public name) does not take: not a variant, or one of ``exclude``; NotImplementedError
    when one is given (not at its default) that the kernels of ``target`` (a
    :mod:`sdpa_numba.targets` target, or None: not checked) do not run."""
    for name, x in variants.items():
        v = BY_NAME.get(name)
        if v is None or name in exclude:
            raise TypeError(f"{func}() got an unexpected keyword argument {name!r}")
        if target is not None and target.name not in v.targets and not is_default(name, x):
            raise NotImplementedError(f"{func}: {name} is not built for {target.name} arrays "
                                      f"yet (it runs on {', '.join(v.targets)} arrays)")


def keyword_signature(func, exclude=(), defaults=None):
    """``func``'s signature with its ``**variants`` spelled out as keyword-only parameters
    (those of :data:`VARIANTS` less ``exclude``, with ``defaults`` overriding the table's):
    what :func:`inspect.signature` and ``help`` show for a public function."""
    defaults = defaults or {}
    sig = inspect.signature(func)
    params = [p for p in sig.parameters.values() if p.kind is not p.VAR_KEYWORD]
    params += [inspect.Parameter(v.name, inspect.Parameter.KEYWORD_ONLY,
                                 default=defaults.get(v.name, v.default), annotation=Any)
               for v in VARIANTS if v.name not in exclude
               and v.name not in sig.parameters]
    return sig.replace(parameters=params)


def variant_grads(recipe, variants, rows):
    """The gradients of the variants given (those of :data:`WITH_GRAD`), in the table's order,
    from the plan's recipe and ``rows()``, which returns the host arrays ``(grad_out, out,
    lse)`` (rows as ``(..., Hq, L)``; called only when a gradient is wanted: it may copy from
    the device): each in the float dtype the caller gave it in (float32 or float64, checked by
    the plan). The backward returns them last."""
    wanted = [v for v in WITH_GRAD if variants.get(v.name) is not None]
    if not wanted:
        return ()
    grad_out, out, lse = rows()
    return tuple(v.grad(recipe, grad_out, out, lse).astype(
                     host_array(v.name, variants[v.name]).dtype) for v in wanted)


F = TypeVar("F", bound=Callable[..., Any])


def takes_variants(exclude: tuple = (), defaults: dict | None = None) -> Callable[[F], F]:
    """Decorator of a public function that takes the variants as ``**variants``: sets its
    ``__signature__`` (:func:`keyword_signature`)."""
    def wrap(func: F) -> F:
        func.__signature__ = keyword_signature(func, exclude, defaults)  # type: ignore[attr-defined]
        return func
    return wrap
