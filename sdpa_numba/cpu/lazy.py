"""Functions of jitted code compiled on their first call, not with the code that calls them.

A kernel that may call a rarely used function (the soft cap's tile passes: a runtime parameter
of the one dense kernel) pays for compiling it on every first call of the kernel, used or not.
Through :class:`Lazy`, the kernel calls it through a pointer kept in a cell of this process (an
external global symbol, which the JIT resolves when the kernel's code is loaded, from Numba's
cache too): the cell first points at a trampoline that compiles the function (a ``cfunc``,
cached on disk), points the cell at it and runs it; every later call goes straight to the
compiled code. :meth:`Lazy.compile` does the same ahead of a launch, so that a launcher
that knows the function will be needed never enters the trampoline from a parallel region.

The trampoline is a ``ctypes`` callback: it takes the GIL to compile. Numba's parallel
launches release the GIL around their loop (and the kernels are ``nogil``), so a worker
thread of a kernel, or of a user's ``prange`` loop calling one, gets it; a thread that holds
it (a serial jitted caller) takes it again. A failure to compile aborts the process with its
traceback: a callback cannot raise into jitted code, and the tile would stay uncomputed.
"""

import ctypes
import os
import sys
import threading
import traceback
import zlib

from llvmlite import binding, ir
from numba import cfunc, types
from numba.extending import intrinsic

from .options import CACHE, CALLED

#: Every cell made in this process (see _Cell).
_ALIVE = []

_C = {types.float32: ctypes.c_float, types.float64: ctypes.c_double,
      types.int64: ctypes.c_int64}


def _ctype(t):
    if isinstance(t, types.CPointer):
        return ctypes.c_void_p
    return _C[t]


class Lazy:
    """A function ``build()`` (a Python function that ``@njit`` could compile, taking
    pointers, int64 and floats) compiled as a C callback for each signature of ``sigs`` on
    its first call with it or by :meth:`compile`, and callable from jitted code by :attr:`call`
    (an intrinsic taking the arguments of one of ``sigs``, typed exactly so, literals aside).

    ``name`` names the cells' symbols, with the source file of ``build`` (a name the kernels'
    cached code keeps: stable across processes, and distinct for two checkouts of the package
    imported in one process, as an A/B script does). The symbols are part of the callers'
    cached code: a change of their form goes with a change of ``name`` in the callers' source
    file, which invalidates the callers' cache entries (a cached caller whose symbol is
    missing could not be loaded: the JIT aborts the process).
    """

    def __init__(self, name, sigs, build):
        self._build = build
        self._lock = threading.Lock()
        where = zlib.crc32(build.__code__.co_filename.encode())
        self._sigs = {tuple(sig.args): _Cell(f"sdpa_numba.lazy.{name}.{where:08x}.{n}", sig,
                                             self)
                      for n, sig in enumerate(sigs)}
        self.call = self._intrinsic()

    def compile(self, *argtypes):
        """Compile the function for the argument types ``argtypes`` (Numba types) or load it
        from Numba's cache, and point its cell at it; idempotent, thread-safe. Returns the
        ``cfunc``."""
        return self._sigs[tuple(argtypes)].compile()

    def compiled(self, *argtypes):
        """Whether it is compiled for ``argtypes`` in this process."""
        return self._sigs[tuple(argtypes)].compiled is not None

    def _intrinsic(self):
        cells = self._sigs

        def typer(typingctx, args):
            cell = cells.get(tuple(types.unliteral(a) for a in args))
            if cell is None:
                return None
            sig, symbol = cell.sig, cell.symbol

            def codegen(context, builder, signature, llargs):
                mod = builder.module
                fnty = ir.FunctionType(ir.VoidType(),
                                       [context.get_value_type(a) for a in sig.args])
                gv = mod.globals.get(symbol)
                if gv is None:  # declared, not defined: the JIT resolves it to the cell
                    gv = ir.GlobalVariable(mod, fnty.as_pointer(), symbol)
                    gv.linkage = "external"
                llargs = [context.cast(builder, v, t, a)
                          for v, t, a in zip(llargs, signature.args, sig.args)]
                builder.call(builder.load(gv), llargs)
                return context.get_dummy_value()

            return types.void(*args), codegen

        n = len(next(iter(cells)))
        params = ", ".join(f"a{i}" for i in range(n))
        scope = {"typer": typer}
        exec(f"def call_lazy(typingctx, {params}):\n"
             f"    return typer(typingctx, ({params},))\n", scope)
        return intrinsic(scope["call_lazy"])


class _Cell:
    """One signature's cell, trampoline and compiled function."""

    def __init__(self, symbol, sig, lazy):
        self.symbol = symbol
        self.sig = sig
        self.lazy = lazy
        self.compiled = None
        self._proto = ctypes.CFUNCTYPE(None, *map(_ctype, sig.args))
        self._trampoline = self._proto(self._first_call)
        # The address the kernels call: kept alive by this object (held at module level).
        self.cell = ctypes.c_void_p(ctypes.cast(self._trampoline, ctypes.c_void_p).value)
        binding.add_symbol(symbol, ctypes.addressof(self.cell))
        # Kernels loaded while this cell was the symbol's keep its address: never freed (a
        # reloaded module makes a new cell and points the symbol at it).
        _ALIVE.append(self)

    def compile(self):
        with self.lazy._lock:
            if self.compiled is None:
                f = cfunc(self.sig, cache=CACHE, **CALLED)(self.lazy._build())
                self._direct = self._proto(f.address)
                self.compiled = f
                self.cell.value = f.address
        return self.compiled

    def _first_call(self, *args):
        try:
            self.compile()
            self._direct(*args)
        except BaseException:  # a callback cannot raise into jitted code: never go on wrong
            traceback.print_exc()
            sys.stderr.write(f"sdpa_numba: {self.symbol} could not be compiled; aborting\n")
            sys.stderr.flush()
            os.abort()
