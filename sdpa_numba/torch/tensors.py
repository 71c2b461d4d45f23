"""Tensors in and out of the PyTorch operators: the checks of what the operators take, the
NumPy views (CPU) or detached tensors (CUDA) the NumPy-level API is given, its results as
tensors, the dropout seed, and the result shapes and dtypes the fake kernels give."""

import numpy as np
import torch
from torch import Tensor

from .._bf16 import is_bfloat16
from ..problem import compute_dtype
from ..problem.variant_table import TORCH_TENSORS, VARIANTS

FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_U64 = 1 << 64


#: The 8-bit KV-cache dtypes (quantized caches, whose scales come as ``k_scale``/``v_scale``):
#: the NumPy dtype the kernels read the same bytes as (ml_dtypes' for float8).
QUANT_CACHES = {torch.int8: "int8", torch.float8_e4m3fn: "e4m3fn", torch.float8_e5m2: "e5m2"}


def check_tensor(t, name, mask=False, cache=False):
    """TypeError / NotImplementedError for what the operator does not take (``cache``: a KV
    cache, which may also be one of :data:`QUANT_CACHES`)."""
    if t is None:
        return
    if not isinstance(t, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.device.type not in ("cpu", "cuda", "meta"):
        raise NotImplementedError(
            f"{name} is on {t.device}: sdpa_numba.torch supports CPU and CUDA tensors only")
    if cache and t.dtype in QUANT_CACHES:
        return
    if t.dtype not in FLOATS and not (mask and t.dtype == torch.bool):
        raise TypeError(f"{name} dtype {t.dtype} is not supported: use float16, bfloat16, "
                        f"float32 or float64" + (" (or bool)" if mask else ""))


def operand(t, name, mask=False):
    """What the kernels take for tensor ``t``: a NumPy view of a CPU tensor, the detached
    CUDA tensor itself (the API adopts it without a copy), None for None."""
    if t is None:
        return None
    check_tensor(t, name, mask)
    if t.device.type != "cpu":
        return t.detach()
    if t.dtype == torch.bfloat16:  # NumPy has no bfloat16: ml_dtypes' over the same bits
        from .._bf16 import bfloat16

        return t.detach().view(torch.int16).numpy().view(bfloat16())
    return t.detach().numpy()


def cache_operand(t, name):
    """A KV cache for the kernels: :func:`operand`, and for an 8-bit cache a NumPy view of the
    same bytes (int8, or ml_dtypes' float8 types). Quantized caches run on the CPU only."""
    if t is None or t.dtype not in QUANT_CACHES:
        return operand(t, name)
    check_tensor(t, name, cache=True)
    if t.device.type != "cpu":
        raise NotImplementedError(f"{name} is an 8-bit ({t.dtype}) cache on {t.device}: "
                                  f"quantized caches run on the CPU only")
    if t.dtype == torch.int8:
        return t.detach().numpy()
    try:
        import ml_dtypes
    except ImportError:
        raise TypeError(f"{name} is a {t.dtype} cache, which needs the ml_dtypes package "
                        f"(pip install ml_dtypes)") from None
    fp8 = getattr(ml_dtypes, "float8_" + QUANT_CACHES[t.dtype])
    return t.detach().view(torch.uint8).numpy().view(fp8)


def as_tensor(x):
    """A result of the kernels as a new contiguous tensor (CUDA results already are tensors,
    the query's kind)."""
    if isinstance(x, Tensor):
        return x.contiguous()
    x = np.ascontiguousarray(x)
    if is_bfloat16(x.dtype):
        return torch.from_numpy(x.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(x)


def small_operand(t, name):
    """ALiBi slopes or sinks for the kernels: a float32/float64 NumPy view (a CUDA tensor is
    passed as is: the API copies it to the host), 16-bit tensors as float32 (the API takes
    float32/float64 only; these are per-head numbers, a copy is nothing), or None."""
    if t is None:
        return None
    if not isinstance(t, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor or None, got {type(t).__name__}")
    if t.dtype not in FLOATS:
        raise TypeError(f"{name} dtype {t.dtype} is not supported: use a floating dtype")
    t = t.detach()
    if t.dtype in (torch.float16, torch.bfloat16):
        t = t.float()
    return t.numpy() if t.device.type == "cpu" else t


# --- the variants across the operators' schemas (sdpa_numba.problem.variant_table) ----------

def _op_arguments():
    """``(name, schema type, default)`` of the operators' variant arguments, from the table:
    the window as two sides, ints, strings, floats and tensors as themselves (the Numba-level
    variants cross no schema)."""
    args = []
    for v in VARIANTS:
        if v.torch == "window":
            args += [("window_left", "SymInt?", None), ("window_right", "SymInt?", None)]
        elif v.torch == "int":
            args.append((v.name, "SymInt?", None))
        elif v.torch == "str":
            args.append((v.name, "str", v.default))
        elif v.torch == "float":
            args.append((v.name, "float?", None))
        elif v.torch == "tensor":
            args.append((v.name, "Tensor?", None))
    return tuple(args)


#: The operators' variant arguments, last in every schema: ``(name, schema type, default)``.
OP_VARIANTS = _op_arguments()
#: Their names, and the tensors among them (read on the host by the NumPy-level API).
OP_NAMES = tuple(name for name, _, _ in OP_VARIANTS)
OP_TENSORS = tuple(v.name for v in TORCH_TENSORS)


def variants_schema(optional_strings=False):
    """The schema text of the variant arguments (after an operator's own); with
    ``optional_strings`` the strings default to None (the KV-cache operators: the API's
    defaults apply)."""
    def one(name, typ, default):
        if typ == "str" and optional_strings:
            return f"str? {name}=None"
        return f'{typ} {name}={"None" if default is None else chr(34) + default + chr(34)}'
    return ", ".join(one(*a) for a in OP_VARIANTS)


def op_schema(head, results, optional_strings=False):
    """An operator's schema: its own arguments ``head`` (text), the variants', ``results``."""
    return f"({head}, {variants_schema(optional_strings)}) -> {results}"


def define_op(name, body, head, n_results=2, mutates_args=(), optional_strings=False,
              tail=None):
    """The operator ``torch.ops.sdpa_numba.<name>`` on Python function ``body``, its schema
    the op's own arguments ``head``, the variants' (:func:`op_schema`), then ``tail`` (text:
    arguments added later, optional so that positional callers keep working), and
    ``n_results`` tensors."""
    results = "(" + ", ".join(["Tensor"] * n_results) + ")"
    schema = op_schema(head, results, optional_strings)
    if tail:
        args, results = schema.rsplit(") -> ", 1)
        schema = f"{args}, {tail}) -> {results}"
    return torch.library.custom_op(f"sdpa_numba::{name}", body, mutates_args=mutates_args,
                                   schema=schema)


def op_variants(values, optional_strings=False):
    """The op's variant arguments as a dict (name: value), from the trailing arguments
    ``values`` (the dispatcher may leave out those at their defaults)."""
    values = tuple(values)
    out = {}
    for n, (name, typ, default) in enumerate(OP_VARIANTS):
        if n < len(values):
            out[name] = values[n]
        else:
            out[name] = None if optional_strings and typ == "str" else default
    return out


def op_values(variants):
    """The op's variant arguments in order (a tuple) from a dict of them."""
    return tuple(variants[name] for name in OP_NAMES)


def host_tensors(variants):
    """``(name, tensor or None)`` of the op's tensor variants, for :func:`check_devices`."""
    return [(name, variants[name]) for name in OP_TENSORS]


def variant_keywords(variants, given_only=False):
    """The keywords of the NumPy-level API for the op's variant arguments (a dict, see
    :func:`op_variants`); ``given_only``: those left at None are not passed."""
    kw = {}
    for v in VARIANTS:
        if v.torch == "window":
            left, right = variants["window_left"], variants["window_right"]
            kw[v.name] = None if left is None and right is None else (left, right)
        elif v.torch == "tensor":
            kw[v.name] = small_operand(variants[v.name], v.name)
        elif v.torch is not None:
            kw[v.name] = variants[v.name]
    if given_only:
        kw = {k: x for k, x in kw.items() if x is not None}
    return kw


def public_variants(window=None, **given):
    """The op's variant arguments (a dict) from the public wrappers' keywords: the window's
    sides (with the NumPy-level API's errors for a bad window), the rest as given."""
    from ..problem.variants import check_window

    check_window(window)  # TypeError / ValueError naming the argument
    left, right = (None, None) if window is None else (
        tuple(None if x is None else int(x) for x in window))
    values = {"window_left": left, "window_right": right}
    for name, _, default in OP_VARIANTS:
        if name not in values:
            values[name] = given.get(name, default)
    return values


def kernel_seed(seed):
    """The kernels' seed (an int in [0, 2**64)) from the op's 0-dim int64 tensor, or None."""
    return None if seed is None else int(seed.item()) % _U64


def seed_tensor(seed, dropout_p):
    """The op's seed argument: None without dropout; a draw from torch's generator when
    ``seed`` is None; else the int64 with the bits of ``seed`` (an int in [0, 2**64))."""
    if not dropout_p > 0:
        return None
    if seed is None:
        return torch.randint(-(1 << 63), (1 << 63) - 1, (), dtype=torch.int64)
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise TypeError(f"seed must be an int or None, got {type(seed).__name__}")
    if not 0 <= seed < _U64:
        raise ValueError(f"seed must be in [0, 2**64), got {seed}")
    return torch.tensor(seed - _U64 if seed >= 1 << 63 else seed, dtype=torch.int64)


def lse_dtype(dtype):
    """The compute dtype of a torch dtype (:func:`sdpa_numba.problem.compute_dtype`)."""
    return getattr(torch, compute_dtype(dtype).name)


def out_shape(query, key, value, enable_gqa):
    """The output's shape, as :func:`sdpa_numba.problem.plan` gives it, in torch terms (so that
    symbolic shapes propagate under torch.compile)."""
    ndims = (query.dim(), key.dim(), value.dim())
    nd = max(*ndims, 3)
    qs, ks, vs = ((1,) * (nd - x.dim()) + tuple(x.shape) for x in (query, key, value))
    batch = tuple(torch.broadcast_shapes(qs[:-3], ks[:-3], vs[:-3]))
    hq = qs[-3] if enable_gqa else torch.broadcast_shapes((qs[-3],), (ks[-3],))[0]
    shape = (*batch, hq, qs[-2], vs[-1])
    return shape[1:] if nd > max(ndims) else shape  # 2-D inputs: no head dim


def index_operand(t, name):
    """An integer argument of the serving op (``cache_seqlens``, ``block_table``,
    ``cache_leftpad``) for the NumPy-level API: a NumPy view of a CPU tensor, a CUDA tensor as
    is (the API reads these on the host), None for None."""
    if t is None:
        return None
    check_index(t, name)
    t = t.detach()
    return t.numpy() if t.device.type == "cpu" else t


def check_index(t, name):
    """TypeError unless ``t`` is an integer tensor."""
    if not isinstance(t, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool:
        raise TypeError(f"{name} must be an integer tensor, got dtype {t.dtype}")


def check_devices(op, tensors, host=()):
    """ValueError unless the tensors (``(name, tensor or None)`` pairs) share one device type,
    as torch's SDPA requires; ``host`` ones (read on the host by the NumPy-level API: seeds,
    sequence lengths, block tables, ALiBi slopes, sinks) may also be CPU tensors. Checked in
    the operators and their fake kernels: with a meta tensor among CPU ones the Meta dispatch
    key wins, and the fake kernel would return uninitialized memory instead of an error."""
    devices = [(name, t.device.type) for name, t in tensors if isinstance(t, Tensor)]
    kind = devices[0][1]
    others = [(name, t.device.type) for name, t in host if isinstance(t, Tensor)]
    if all(d == kind for _, d in devices) and all(d in (kind, "cpu") for _, d in others):
        return
    where = ", ".join(f"{name} on {d}" for name, d in devices + others)
    names = ", ".join(name for name, _ in devices)
    also = ", ".join(name for name, _ in others)
    extra = f" ({also}: that one or the CPU)" if others else ""
    raise ValueError(f"{op}: expected {names} to have the same device type{extra}, got "
                     f"{where}")
