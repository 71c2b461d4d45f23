"""XLA's FFI call frame read from jitted code, by the C layout of ``xla/ffi/api/c_api.h``.

An XLA FFI handler is ``XLA_FFI_Error* handler(XLA_FFI_CallFrame*)``; a Numba ``@cfunc`` of
signature ``intp(intp)`` has that ABI on the 64-bit platforms jaxlib ships for (pointers are
passed and returned as 64-bit integers). The offsets below are those of the header's structs
on such a platform (8-byte pointers, ``size_t`` and ``int64_t``; 4-byte enums padded to 8
before a pointer):

* ``XLA_FFI_CallFrame``: ``struct_size`` 0, ``extension_start`` 8, ``api`` 16, ``ctx`` 24,
  ``stage`` 32, ``args`` 40 (an ``XLA_FFI_Args`` of 40 bytes: ``size`` at +16, ``args`` at
  +32), ``rets`` 80 (the same layout), ``attrs`` 120, ``future`` 168;
* ``XLA_FFI_Buffer``: ``dtype`` 16, ``data`` 24, ``rank`` 32, ``dims`` 40;
* ``XLA_FFI_Extension_Base``: ``type`` 8; the metadata extension's ``XLA_FFI_Metadata*`` at
  24, whose ``api_version`` (an ``XLA_FFI_Api_Version``) has ``major_version`` at 24 and
  ``minor_version`` at 28.

XLA first calls a handler with the metadata extension in the frame, to learn the FFI version
it was built for (the CPU backend refuses a handler that does not answer); :func:`answer_metadata`
writes it. Everything here is ``@njit`` inlined into the handlers: no Python on the call path.
"""

import numpy as np
from numba import carray, njit, types
from numba.core import cgutils
from numba.extending import intrinsic

from ..targets import HOST

CACHE = HOST.caching()  # cached beside the kernels when they are

#: The FFI version the handlers declare (the typed FFI's first: every jaxlib with
#: ``jax.ffi`` accepts it).
API_MAJOR, API_MINOR = 0, 1
_METADATA = 1  # XLA_FFI_Extension_Metadata

_ARGS = 40 + 32   # XLA_FFI_CallFrame.args.args
_RETS = 80 + 32   # XLA_FFI_CallFrame.rets.rets
_DATA, _RANK, _DIMS = 24, 32, 40  # in XLA_FFI_Buffer


@intrinsic
def as_pointer(typingctx, addr):
    """The address ``addr`` (an integer) as a ``void*``."""
    def codegen(context, builder, sig, args):
        return builder.inttoptr(args[0], cgutils.voidptr_t)
    return types.voidptr(types.intp), codegen


@njit(cache=CACHE)
def load_i64(addr):
    """The int64 at ``addr``."""
    return carray(as_pointer(addr), (1,), np.int64)[0]


@njit(cache=CACHE)
def store_i32(addr, x):
    """Store int32 ``x`` at ``addr``."""
    carray(as_pointer(addr), (1,), np.int32)[0] = x


@njit(cache=CACHE)
def answer_metadata(frame):
    """Whether ``frame`` is XLA's metadata query (then the version is written: the handler
    returns at once)."""
    ext = load_i64(frame + 8)
    if ext == 0 or (load_i64(ext + 8) & 0xFFFFFFFF) != _METADATA:
        return False
    metadata = load_i64(ext + 24)
    store_i32(metadata + 24, API_MAJOR)
    store_i32(metadata + 28, API_MINOR)
    return True


@njit(cache=CACHE)
def argument(frame, n):
    """The address of operand ``n``'s ``XLA_FFI_Buffer``."""
    return load_i64(load_i64(frame + _ARGS) + 8 * n)


@njit(cache=CACHE)
def result(frame, n):
    """The address of result ``n``'s ``XLA_FFI_Buffer``."""
    return load_i64(load_i64(frame + _RETS) + 8 * n)


@njit(cache=CACHE)
def data(buffer):
    """A buffer's data address."""
    return load_i64(buffer + _DATA)


@njit(cache=CACHE)
def dims(buffer):
    """A buffer's dims, an int64 array (a view of XLA's)."""
    return carray(as_pointer(load_i64(buffer + _DIMS)), (load_i64(buffer + _RANK),),
                  np.int64)


@intrinsic
def _call_pointer(typingctx, fn, arg):
    """``((intptr_t (*)(intptr_t)) fn)(arg)``."""
    def codegen(context, builder, sig, args):
        i64 = context.get_value_type(types.intp)
        fnty = cgutils.ir.FunctionType(i64, [i64])
        f = builder.inttoptr(args[0], fnty.as_pointer())
        return builder.call(f, [args[1]])
    return types.intp(types.intp, types.intp), codegen


_INTERNAL = 13  # XLA_FFI_Error_Code_INTERNAL
_ERROR_CREATE = 48  # XLA_FFI_Api.XLA_FFI_Error_Create (after struct_size, extension_start,
#                     the 24-byte api_version and internal_api)


@njit(cache=CACHE)
def error(frame, message):
    """A new ``XLA_FFI_Error*`` carrying ``message`` (a NUL-terminated uint8 array; XLA copies
    it), made by the API's ``XLA_FFI_Error_Create``: what a handler returns to fail the call,
    so that the error reaches the caller as an exception."""
    api = load_i64(frame + 16)
    args = np.zeros(4, np.int64)  # XLA_FFI_Error_Create_Args
    args[0] = 28  # struct_size: offsetof(errc) + sizeof(errc)
    args[2] = message.ctypes.data
    args[3] = _INTERNAL
    return _call_pointer(load_i64(api + _ERROR_CREATE), args.ctypes.data)


def c_string(text):
    """``text`` as a NUL-terminated uint8 array (an :func:`error` message)."""
    return np.frombuffer(text.encode() + b"\0", np.uint8).copy()


def ranked(source, nd, **env):
    """The ``@njit`` function that ``source`` (one ``def``) defines for rank ``nd``: ``{nd}``
    in it becomes ``nd`` and ``{last}`` the last ``nd`` dims of a dims array ``d`` of rank
    ``r``, ``d[r - nd], ..., d[r - 1],`` (a tuple's entries: a carray's shape must be a tuple
    of a size known when compiling, so each rank is its own function). ``env``: its
    globals (Numba freezes them as constants)."""
    last = "".join(f"d[r - {nd - i}], " for i in range(nd))
    namespace = dict(env)
    exec(compile(source.format(nd=nd, last=last), f"<sdpa_numba.jax rank {nd}>", "exec"),
         namespace)
    names = [x for x in namespace if x not in env and x != "__builtins__"]
    return njit(namespace[names[0]])
