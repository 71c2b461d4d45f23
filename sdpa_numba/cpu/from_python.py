"""The jitted entry points as called from outside the package: from Python, clear errors for
arrays they cannot take (:func:`explain_float16`); from users' jitted code, one specialization
whether an argument is a constant or a variable (:func:`one_type_per_argument`).

Numba's CPU target types a float16 array but cannot lower it, so a call with one fails deep
in the compiler with ``NotImplementedError: float16``. The kernels take float16 storage as a
``uint16`` view; :func:`explain_float16` makes such a call say so. The check runs only where
Numba is about to compile for new argument types, never on the fast path of a call that
matches a compiled signature (and never inside users' jitted code, which cannot hold float16
arrays either).
"""

import types as pytypes

import numpy as np
from numba.core import types


def _float16_arg(dispatcher, args, kws):
    names = dispatcher.py_func.__code__.co_varnames[:dispatcher.py_func.__code__.co_argcount]
    for name, a in [*zip(names, args), *kws.items()]:
        if isinstance(a, np.ndarray) and a.dtype == np.float16:
            return name
    return None


def explain_float16(dispatcher):
    """Make ``dispatcher``, called from Python on a float16 array, raise a TypeError that
    says to pass a uint16 view."""
    compile_for_args = getattr(dispatcher, "_compile_for_args", None)
    if compile_for_args is None:  # NUMBA_DISABLE_JIT=1: a plain Python function
        return dispatcher

    def _compile_for_args(*args, **kws):
        name = _float16_arg(dispatcher, args, kws)
        if name is not None:
            raise TypeError(
                f"sdpa_numba.cpu.{dispatcher.py_func.__name__}: {name} is a float16 array, "
                f"which Numba's CPU target cannot compile; pass float16 data as a uint16 view "
                f"(x.view(np.uint16)): the kernels read uint16 storage as float16 bits and "
                f"compute in float32")
        return compile_for_args(*args, **kws)

    dispatcher._compile_for_args = _compile_for_args
    return dispatcher


def one_type_per_argument(dispatcher):
    """Make calls of ``dispatcher`` from jitted code type constants as the variables they stand
    for: ``True`` as ``bool``, ``3`` as ``int64``, an omitted ``None`` default as ``None``.

    Numba compiles a jitted function called from jitted code for the call's argument types
    as they are, and a constant's type is its literal: ``forward(..., True, ...)``,
    ``forward(..., False, ...)`` and ``forward(..., causal, ...)`` in a user's function were
    three specializations of the kernel (measured: ``Literal[bool](True)``,
    ``Literal[bool](False)`` and ``bool``), ten seconds or more of compiling each. The kernels
    take every such argument as a run-time value, so one specialization serves all three.
    (Calls from Python are typed by value already: this changes nothing there.)
    """
    base = getattr(type(dispatcher), "get_call_template", None)
    if base is None:  # NUMBA_DISABLE_JIT=1: a plain Python function
        return dispatcher

    def get_call_template(self, args, kws):
        _, folded = self._compiler.fold_argument_types(args, kws)
        folded = tuple(types.none if isinstance(a, types.Omitted) and a.value is None
                       else types.unliteral(a) for a in folded)
        return base(self, folded, {})

    dispatcher.get_call_template = pytypes.MethodType(get_call_template, dispatcher)
    return dispatcher
