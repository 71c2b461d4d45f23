"""The public function: validation, broadcasting and dispatch to the CPU or CUDA kernels.

Validation happens here, once, before any jitted code runs; the kernels trust their arguments.
Everything about shapes is worked out by :func:`plan` on shapes and dtypes alone, so that the
CPU and CUDA back ends share it; each back end then builds strided views (never copies) of the
operands in the kernels' 4-D layout.
"""

import math
import numbers
from dataclasses import dataclass
from typing import Any, Literal, overload

import numpy as np
import numpy.typing as npt

from ._bf16 import is_bfloat16
from ._typing import F16, F32, ArrayT, Mask, SelfComputed
from .dropout import check_seed, new_seed
from .host_arrays import adopt as adopt_host
from .host_arrays import is_host_array
from .dropout import params as dropout_params

_FLOATS = (np.dtype(np.float16), np.dtype(np.float32), np.dtype(np.float64))


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


def _shape_str(x):
    return "(" + ", ".join(str(int(n)) for n in x.shape) + ")"


def _check_flag(name, value):
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name} must be a bool, got {type(value).__name__}")
    return bool(value)


def _broadcast(shapes, names, what):
    """NumPy broadcasting of ``shapes``, with an error that names the arguments."""
    try:
        return tuple(np.broadcast_shapes(*shapes))
    except ValueError:
        desc = ", ".join(f"{n} {tuple(s)}" for n, s in zip(names, shapes))
        raise ValueError(f"{what} do not broadcast: {desc}") from None


def plan(query, key, value, attn_mask, is_causal, scale, enable_gqa):
    """Validate the arguments' shapes, dtypes and flags; return a :class:`Plan`.

    Works on anything with ``shape``, ``ndim`` and a NumPy ``dtype`` (host or device arrays).
    """
    is_causal = _check_flag("is_causal", is_causal)
    enable_gqa = _check_flag("enable_gqa", enable_gqa)
    for name, x in (("query", query), ("key", key), ("value", value)):
        if x.ndim < 2:
            raise ValueError(f"{name} must have at least 2 dims (..., L, E), got shape "
                             f"{_shape_str(x)}")
    dtype = np.dtype(query.dtype)
    if dtype not in _FLOATS and not is_bfloat16(dtype):
        if dtype.kind == "f" and dtype.newbyteorder("=") in _FLOATS:
            raise TypeError(f"query dtype {dtype.str} is not in the machine's byte order: "
                            f"pass query.astype(query.dtype.newbyteorder('='))")
        raise TypeError(f"query dtype {dtype} is not supported: use float16, bfloat16 "
                        f"(ml_dtypes.bfloat16), float32 or float64")
    for name, x in (("key", key), ("value", value)):
        if np.dtype(x.dtype) != dtype:
            raise TypeError(f"{name} dtype {np.dtype(x.dtype)} differs from query dtype {dtype}")

    L, E = query.shape[-2:]
    S, Ek = key.shape[-2:]
    Sv, Ev = value.shape[-2:]
    if Ek != E:
        raise ValueError(f"key's last dim must equal query's: query {_shape_str(query)}, "
                         f"key {_shape_str(key)}")
    if Sv != S:
        raise ValueError(f"value must have as many rows as key: key {_shape_str(key)}, "
                         f"value {_shape_str(value)}")

    nd = max(query.ndim, key.ndim, value.ndim, 3)
    qs, ks, vs = ((1,) * (nd - x.ndim) + tuple(x.shape) for x in (query, key, value))
    batch = _broadcast([qs[:-3], ks[:-3], vs[:-3]], ["query", "key", "value"],
                       "batch dims of query, key and value")
    hq, hk, hv = qs[-3], ks[-3], vs[-3]
    if hk != hv:
        raise ValueError(f"key and value must have the same number of heads: key "
                         f"{_shape_str(key)}, value {_shape_str(value)}")
    if enable_gqa:
        if hk == 0 or hq % hk:
            raise ValueError(f"enable_gqa needs query heads to be a multiple of key/value heads:"
                             f" query {_shape_str(query)}, key {_shape_str(key)}")
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
                             f"query {_shape_str(query)}, key {_shape_str(key)}, value "
                             f"{_shape_str(value)}")
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
            raise ValueError(f"attn_mask of shape {_shape_str(attn_mask)} does not broadcast "
                             f"to the scores' shape {scores} (..., Hq, L, S)")

    if scale is None:
        scale = 1.0 / math.sqrt(E) if E else 1.0
    else:
        if isinstance(scale, (bool, np.bool_)) or not isinstance(scale, numbers.Real):
            raise TypeError(f"scale must be a real number or None, got {type(scale).__name__}")
        scale = float(scale)
        if not math.isfinite(scale):
            raise ValueError(f"scale must be finite, got {scale}")

    cdt = np.dtype(np.float64) if dtype == np.float64 else np.dtype(np.float32)
    return Plan(batch, hq, h, L, S, E, Ev, out_shape, dtype, cdt, scale, is_causal, mask_kind)


def check_dropout(dropout_p):
    """``dropout_p`` as a float in [0, 1); TypeError / ValueError otherwise."""
    if isinstance(dropout_p, (bool, np.bool_)) or not isinstance(dropout_p, numbers.Real):
        raise TypeError(f"dropout_p must be a real number, got {type(dropout_p).__name__}")
    if not 0.0 <= float(dropout_p) < 1.0:  # also rejects NaN
        raise ValueError(f"dropout_p must be in [0, 1), got {dropout_p}")
    return float(dropout_p)


def may_self_overlap(shape, strides, itemsize):
    """Whether two elements of a strided array may share bytes (False: they never do).

    Dims of size 1 don't move; the others, taken by increasing |stride|, must each step over
    everything the smaller dims span. That is exact for every layout made by slicing,
    transposing or reshaping a contiguous array, and conservative for the rest (interleaved
    layouts that happen not to overlap are reported as overlapping). NumPy has no public test.
    """
    if any(n == 0 for n in shape):
        return False
    span = itemsize  # bytes covered by one element and the dims already checked
    for n, s in sorted(((n, abs(int(s))) for n, s in zip(shape, strides) if n > 1),
                       key=lambda d: d[1]):
        if s < span:
            return True
        span += s * (n - 1)
    return False


def _check_out(p, out, inputs):
    """``out`` must match the result exactly and be safe to write."""
    if tuple(out.shape) != p.out_shape or np.dtype(out.dtype) != p.dtype:
        raise ValueError(f"out must have shape {p.out_shape} and dtype {p.dtype}, got "
                         f"{_shape_str(out)} {np.dtype(out.dtype)}")
    # Overlapping elements would be written by several threads, in no fixed order.
    if out.size and any(s == 0 and n > 1 for s, n in zip(out.strides, out.shape)):
        raise ValueError(f"out must not have zero strides (a broadcast view), got strides "
                         f"{tuple(out.strides)}")
    if may_self_overlap(out.shape, out.strides, np.dtype(out.dtype).itemsize):
        raise ValueError(f"out's elements overlap each other (strides {tuple(out.strides)} "
                         f"for shape {_shape_str(out)}): pass a buffer in which every "
                         f"element has memory of its own")
    if not isinstance(out, np.ndarray):
        return  # device arrays: the CUDA back end checks what it can
    if not out.flags.writeable:
        raise ValueError("out must be writeable")
    for name, x in inputs:
        if x is not None and np.may_share_memory(out, x):
            raise ValueError(f"out overlaps {name}: pass a separate buffer")


def _is_device_array(x):
    if hasattr(x, "__cuda_array_interface__"):
        return True
    # Numba's CUDA simulator arrays have no __cuda_array_interface__.
    return type(x).__name__ in ("FakeCUDAArray", "DeviceNDArray") and hasattr(x, "copy_to_host")


def _device_of(named, required=()):
    """'host' or 'cuda' for the operands; TypeError for anything else or a mix.

    ``required``: the names that may not be None (the others are optional arguments).
    """
    kinds = {}
    for name, x in named:
        if x is None:
            if name in required:
                raise TypeError(f"{name} must be an array (NumPy, another host array or a "
                                f"CUDA array), got None")
            continue
        if isinstance(x, np.ma.MaskedArray):  # the kernels would read masked values as data
            raise TypeError(f"{name} is a masked array, whose mask attention would ignore: "
                            f"pass np.ma.filled({name}, value) or use attn_mask")
        if isinstance(x, np.matrix):
            raise TypeError(f"{name} is a np.matrix: pass np.asarray({name})")
        if _is_device_array(x):
            kinds[name] = "cuda"
        elif is_host_array(x):
            kinds[name] = "host"
        else:
            raise TypeError(f"{name} must be an array: NumPy, any host array with the array "
                            f"interface, DLPack or the buffer protocol (torch CPU tensors, JAX "
                            f"arrays, ...), or a CUDA array (an object with "
                            f"__cuda_array_interface__), got {type(x).__name__}")
    if not kinds:
        raise TypeError("no array given: query, key and value must be arrays")
    if len(set(kinds.values())) > 1:
        desc = ", ".join(f"{n} on {k}" for n, k in kinds.items())
        raise TypeError(f"inputs mix host and device arrays ({desc}): put them on one device")
    return next(iter(kinds.values()))


def adopt(device, named, out=None):
    """The operands as the arrays the back end reads (NumPy arrays on the host, Numba device
    arrays on the GPU; no copies), and ``restore(x)``, which hands a result back as the
    query's kind of array: see :mod:`sdpa_numba.host_arrays` and
    :func:`sdpa_numba.gpu.arrays.adopt`."""
    if device == "cuda":
        from .gpu.arrays import adopt as adopt_device

        return adopt_device(named, out)
    return adopt_host(named, out)


@overload
def scaled_dot_product_attention(  # type: ignore[overload-overlap]
        query: F16, key: F16, value: F16, attn_mask: Mask = ..., dropout_p: float = ...,
        is_causal: bool = ..., scale: float | None = ..., enable_gqa: bool = ..., *,
        return_lse: Literal[True], out: F16 | None = ..., seed: int | None = ...
) -> tuple[F16, F32]: ...


@overload
def scaled_dot_product_attention(  # type: ignore[overload-overlap]
        query: npt.NDArray[SelfComputed], key: npt.NDArray[SelfComputed],
        value: npt.NDArray[SelfComputed], attn_mask: Mask = ..., dropout_p: float = ...,
        is_causal: bool = ..., scale: float | None = ..., enable_gqa: bool = ..., *,
        return_lse: Literal[True], out: npt.NDArray[SelfComputed] | None = ...,
        seed: int | None = ...
) -> tuple[npt.NDArray[SelfComputed], npt.NDArray[SelfComputed]]: ...


@overload
def scaled_dot_product_attention(
        query: ArrayT, key: ArrayT, value: ArrayT, attn_mask: Mask = ..., dropout_p: float = ...,
        is_causal: bool = ..., scale: float | None = ..., enable_gqa: bool = ..., *,
        return_lse: Literal[False] = ..., out: ArrayT | None = ..., seed: int | None = ...
) -> ArrayT: ...


@overload
def scaled_dot_product_attention(
        query: ArrayT, key: ArrayT, value: ArrayT, attn_mask: Mask = ..., dropout_p: float = ...,
        is_causal: bool = ..., scale: float | None = ..., enable_gqa: bool = ..., *,
        return_lse: Literal[True], out: ArrayT | None = ..., seed: int | None = ...
) -> tuple[ArrayT, ArrayT]: ...


@overload
def scaled_dot_product_attention(
        query: ArrayT, key: ArrayT, value: ArrayT, attn_mask: Mask = ..., dropout_p: float = ...,
        is_causal: bool = ..., scale: float | None = ..., enable_gqa: bool = ..., *,
        return_lse: bool, out: ArrayT | None = ..., seed: int | None = ...
) -> ArrayT | tuple[ArrayT, Any]: ...


def scaled_dot_product_attention(query: Any, key: Any, value: Any, attn_mask: Mask = None,
                                 dropout_p: float = 0.0, is_causal: bool = False,
                                 scale: float | None = None, enable_gqa: bool = False, *,
                                 return_lse: bool = False, out: Any = None,
                                 seed: int | None = None) -> Any:
    """Attention(Q, K, V) = softmax(Q Kᵀ · scale + mask) V, with torch's semantics.

    Parameters
    ----------
    query : ndarray or CUDA array, shape (..., Hq, L, E)
        2-D ``(L, E)`` and 3-D inputs work too. float16, bfloat16 (``ml_dtypes.bfloat16``),
        float32 or float64; any strides.
    key : ndarray or CUDA array, shape (..., H, S, E)
    value : ndarray or CUDA array, shape (..., H, S, Ev)
        Leading (batch) dims of the three broadcast as in NumPy.
    attn_mask : ndarray, optional
        bool (True = takes part) or the query's float dtype (added to the scores; ``-inf``
        allowed), broadcastable to ``(..., Hq, L, S)``. Read in place through its strides.
        Combines with ``is_causal``.
    dropout_p : float
        Probability in [0, 1) of dropping each attention probability; kept ones are scaled by
        ``1 / (1 - p)`` (torch's semantics; ``lse`` is that of the softmax before dropout).
        The mask is a counter-based random stream of ``(seed, batch, head, row, key)`` (see
        :mod:`sdpa_numba.dropout`): never stored, redrawn by the backward from the seed. The
        CPU and CUDA kernels draw the same mask for the same seed.
    is_causal : bool
        Query ``i`` sees keys ``j <= i`` (top-left aligned, as torch).
    scale : float, optional
        Multiplies ``Q Kᵀ``; default ``1 / sqrt(E)``. Must be finite.
    enable_gqa : bool
        Grouped-query attention: ``Hq`` a multiple of ``H``, query head ``h`` uses key/value
        head ``h // (Hq // H)``. Without it, head dims broadcast like batch dims.
    return_lse : bool, keyword-only
        Also return the log-sum-exp of each row's scores, shape ``(..., Hq, L)``, in the
        compute dtype (float32 for float16/bfloat16/float32 inputs, float64 for float64).
    out : array, keyword-only, optional
        Buffer of the output's shape and dtype, written in place and returned.
    seed : int, keyword-only, optional
        Seed of the dropout mask, in ``[0, 2**64)``: the same seed gives the same mask. None
        draws a fresh one, which the caller cannot know: pass a seed when the backward
        (:func:`~sdpa_numba.scaled_dot_product_attention_backward`) must replay the mask.
        Ignored when ``dropout_p == 0``.

    Returns
    -------
    out : array of the inputs' dtype and kind, shape (..., Hq, L, Ev)
    lse : array, only with ``return_lse=True``

    Raises
    ------
    TypeError, ValueError
        For bad input, naming the argument, before any kernel runs.
    NotImplementedError
        For bfloat16 CUDA arrays other than Numba device arrays of ``ml_dtypes.bfloat16`` and
        torch tensors (others' ``__cuda_array_interface__`` does not say bfloat16).

    Notes
    -----
    The scores matrix is never built: the kernels stream key/value blocks with an online
    softmax. A row whose every key is masked gives zeros (and ``lse = -inf``); ``S = 0`` too.
    float16 and bfloat16 compute with float32 accumulators; a bfloat16 output is rounded to
    nearest even. Results do not depend on the thread count.
    """
    device = _device_of([("query", query), ("key", key), ("value", value),
                         ("attn_mask", attn_mask), ("out", out)], ("query", "key", "value"))
    arrays, restore = adopt(device, [("query", query), ("key", key), ("value", value),
                                     ("attn_mask", attn_mask)], out)
    query, key, value, attn_mask = arrays[:4]
    out = arrays[4] if out is not None else None
    p = plan(query, key, value, attn_mask, is_causal, scale, enable_gqa)
    dropout_p = check_dropout(dropout_p)
    seed = check_seed(seed)
    return_lse = _check_flag("return_lse", return_lse)
    if out is not None:
        _check_out(p, out, [("query", query), ("key", key), ("value", value),
                            ("attn_mask", attn_mask)])
    dropout = None
    if dropout_p > 0:
        dropout = dropout_params(dropout_p, new_seed() if seed is None else seed)
    if device == "host":
        from .cpu.launch import run

        result, lse = run(p, query, key, value, attn_mask, out, dropout)
    else:
        from .gpu.launch import run

        result, lse = run(p, query, key, value, attn_mask, out, dropout)
    result, lse = restore(result), restore(lse)
    return (result, lse) if return_lse else result
