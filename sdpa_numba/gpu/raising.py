"""User functions that can raise, refused before a CUDA launch.

A ``score_mod``, ``mask_mod`` or ``score_mod_grad`` is compiled into the kernels as a device
function. numba-cuda (0.30.4) lowers a ``raise`` in a device function, as on the CPU, to an
error status returned to its caller; the caller passes it up, and a kernel compiled without
``debug=True`` (ours: debug code is slow, and needs ``opt=False``) turns the status into a
plain return (``compiler.kernel_fixup``): the raising thread ends silently, its share of the
output unwritten, and the launch reports nothing (the user saw 3.7e37 or NaN). On the CPU the
exception reaches the caller (:mod:`sdpa_numba.cpu.tasks`); on the CUDA simulator too (the
kernel runs as Python).

So on the device, a kernel whose code can raise is refused before its launch, with an error
that names the user's functions: the kernel's LLVM IR (numba's, before NVVM) shows it, as a
function that returns an error status (``ret i32`` of -1, Python's exception, or of a user
exception's number, 1 and up), or calls one that does. The library's own code has no such
path (error_model="numpy", no bounds checks): tests/test_gpu_raising.py checks its kernels.
"""

import re

__all__ = ["raising_functions", "refuse_raising"]

_DEFINE = re.compile(r'^define [^@]*@"?([^"(]+)"?\(', re.M)
_ERROR_STATUS = re.compile(r"\bret i32 (-1|[1-9][0-9]*)\b")
_CALL = re.compile(r'\bcall i32 @"?([^"(]+)"?\(')


def raising_functions(llvm_ir):
    """The names of the functions defined in ``llvm_ir`` (module text) that can return an
    error status: one of their own, or one a function they call returns."""
    starts = [(m.start(), m.group(1)) for m in _DEFINE.finditer(llvm_ir)]
    bodies = {}
    for n, (at, name) in enumerate(starts):
        end = starts[n + 1][0] if n + 1 < len(starts) else len(llvm_ir)
        bodies[name] = llvm_ir[at:end]
    raising = {name for name, body in bodies.items() if _ERROR_STATUS.search(body)}
    calls = {name: set(_CALL.findall(body)) for name, body in bodies.items()}
    grew = True
    while grew:
        more = {name for name, callees in calls.items() if callees & raising} - raising
        raising |= more
        grew = bool(more)
    return raising


def refuse_raising(kernel, functions, args=None):
    """ValueError if the compiled CUDA ``kernel`` (for the launch arguments ``args``, compiled
    here if need be; None: its signatures so far) can raise, naming the user's ``functions``
    (those of them that are not None). On the simulator, or without user functions, nothing
    to check."""
    from .arrays import is_simulated_mode

    functions = [f for f in functions if f is not None]
    if not functions or is_simulated_mode():
        return
    argtypes = None if args is None else tuple(kernel.typeof_pyval(a) for a in args)
    checked = kernel.__dict__.setdefault("_sdpa_raising", {})  # per kernel and signature
    if argtypes not in checked:
        if argtypes is not None:
            kernel.compile(argtypes)
        ir = kernel.inspect_llvm(argtypes) if argtypes is not None else \
            "\n".join(kernel.inspect_llvm().values())
        checked[argtypes] = raising_functions(ir)
    raising = checked[argtypes]
    if raising:
        names = [getattr(f, "__name__", repr(f)) for f in functions]
        which = [n for n in names if any(n in r for r in raising)] or names
        raise ValueError(
            f"{', '.join(which)} can raise an exception (a raise statement, or an operation "
            f"that raises), which a CUDA kernel cannot report: numba-cuda ends the raising "
            f"thread silently and the output would be wrong. Make the function total (e.g. "
            f"return -inf to mask a score), or run on the CPU, where the exception reaches "
            f"the caller")
