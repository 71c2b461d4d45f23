"""How the CPU kernels live with Numba's process-wide machinery: threading layer, fork, JIT
switch and on-disk cache.

* Threading layer. GNU OpenMP (Numba's default choice on Linux when TBB is absent) cannot run a
  parallel region in a process forked after its parent ran one: Numba kills such a child with
  SIGTERM, and a ``multiprocessing`` fork pool then waits forever for the lost task. Unless the
  user chose a layer (``NUMBA_THREADING_LAYER``, ``NUMBA_THREADING_LAYER_PRIORITY``, a
  ``.numba_config.yaml`` or ``numba.config`` set before the first parallel launch),
  :func:`choose_threading_layer` asks Numba for its ``"forksafe"`` layers: TBB if installed
  (the ``tbb`` wheel is a dependency; :func:`load_tbb` makes Numba find it), else
  ``workqueue``. TBB is the one fork-safe layer that is also thread-safe and runs a parallel
  kernel called inside a user's ``prange`` (``workqueue`` aborts the process on that).
  Measured here (2 cores), workqueue is as fast as OpenMP for large calls
  (the kernels schedule their own work through a task queue), wakes much faster after an
  idle pause (0.5 ms against 1-30 ms for a small call), and costs ~0.1 ms more on small
  calls made back to back (0.2 ms against 0.1 ms).
* ``workqueue`` is not thread-safe: two parallel launches at once from two Python threads
  abort the process. :func:`kernel_launch` serializes the CPU kernels' launches under it.
* A forked child of a process that ran GNU OpenMP regions gets a clear RuntimeError from
  :func:`kernel_launch` instead of being killed.
* ``NUMBA_DISABLE_JIT=1``: the kernels use LLVM intrinsics that have no Python form, so they
  cannot run uncompiled; a clear RuntimeError says so.
* :func:`compile_entry`: a truncated cache file (a killed process) is discarded and the
  function recompiled, and a cache that cannot be written (a full disk) is no longer written
  to, each with a warning, instead of failing every later call.
* :func:`caching_available`: where Numba can write no cache at all (package directory, HOME and
  NUMBA_CACHE_DIR unwritable), the kernels are compiled without caching, with a warning.
* :func:`stamp_caches`: Numba judges a cached kernel fresh by its own source file only, so a
  kernel whose inlined helpers changed in another module (a new tanh, a new score seam) would
  load stale machine code from the cache. Every cached kernel of the package is stamped with a
  hash of the whole package's source instead: any change to it recompiles them all.
"""

import hashlib
import os
import sys
import threading
import traceback
import warnings

import numba
from numba.core import config

_DEFAULT_PRIORITY = ["tbb", "omp", "workqueue"]

#: Serializes the CPU kernels' launches under the workqueue layer (reentrant: a launch may
#: split into several).
_lock = threading.RLock()
#: Set in a forked child whose parent had started GNU OpenMP's thread pool.
_omp_inherited = False


def _user_chose_layer():
    return (config.THREADING_LAYER != "default"
            or list(config.THREADING_LAYER_PRIORITY) != _DEFAULT_PRIORITY
            or "NUMBA_THREADING_LAYER" in os.environ
            or "NUMBA_THREADING_LAYER_PRIORITY" in os.environ)


def _layer_started():
    # Looked up, not imported: an import statement at every launch costs a microsecond.
    parallel = sys.modules.get("numba.np.ufunc.parallel")
    return parallel is not None and parallel._is_initialized


def _tbb_library():
    """The path of the ``tbb`` wheel's ``libtbb.so.12`` (``tbb12.dll``), or None."""
    from importlib import metadata

    name = "tbb12.dll" if sys.platform == "win32" else "libtbb.so.12"
    try:
        files = metadata.files("tbb") or ()
    except metadata.PackageNotFoundError:
        return None
    for f in files:
        if f.name == name:
            return str(f.locate())
    return None


def load_tbb():
    """Load the ``tbb`` wheel's library, so that Numba finds it: Numba's TBB layer links
    ``libtbb.so.12`` by name, without a search path, and the wheel puts it in the
    environment's ``lib`` folder, where the dynamic loader does not look (conda and system
    installs are found as they are). Returns whether the library is loaded."""
    import ctypes

    path = _tbb_library()
    if path is None or not os.path.exists(path):
        return False
    try:
        ctypes.CDLL(path, mode=getattr(ctypes, "RTLD_GLOBAL", 0))
    except OSError:
        return False
    return True


def choose_threading_layer():
    """Prefer Numba's fork-safe layers, unless the user chose one or a layer already runs;
    TBB, the one that is also thread-safe and runs nested parallel calls, is loaded from
    the ``tbb`` wheel (a dependency) if installed."""
    if not _layer_started():
        load_tbb()  # also when the user chose "tbb": Numba would not find the wheel's library
        if not _user_chose_layer():
            config.THREADING_LAYER = "forksafe"


def _gnu_omp_running():
    # Runs in a fork handler: look modules up, never import (numba is imported by now).
    parallel = sys.modules.get("numba.np.ufunc.parallel")
    if parallel is None or not parallel._is_initialized or parallel._threading_layer != "omp":
        return False
    omppool = sys.modules.get("numba.np.ufunc.omppool")
    return getattr(omppool, "openmp_vendor", "GNU") == "GNU"


def _after_fork_in_child():
    global _lock, _omp_inherited
    _lock = threading.RLock()  # another thread of the parent may have held it
    _omp_inherited = _gnu_omp_running()


os.register_at_fork(after_in_child=_after_fork_in_child)


def check_jit():
    """RuntimeError under ``NUMBA_DISABLE_JIT=1``, which the CPU kernels cannot run under."""
    if config.DISABLE_JIT:
        raise RuntimeError(
            "sdpa_numba's CPU kernels cannot run with NUMBA_DISABLE_JIT=1: they use LLVM "
            "intrinsics (stack buffers, half-precision conversions, atomics) that have no "
            "pure-Python form. Unset NUMBA_DISABLE_JIT; for a slow, plain NumPy result use "
            "sdpa_numba.reference.")


class _KernelLaunch:
    """The context of :func:`kernel_launch` (a class, not a generator: entered for every
    launch, a generator-based context cost ~12 us a call, a decode step's host budget)."""

    __slots__ = ("_held",)

    def __enter__(self):
        check_jit()
        if _omp_inherited:
            raise RuntimeError(
                "sdpa_numba cannot run in this process: it was forked after its parent ran "
                "Numba parallel code under GNU OpenMP, which cannot run again in a forked child "
                "(Numba would kill it). Use the 'spawn' or 'forkserver' start method, or choose "
                "a fork-safe threading layer in the parent before its first parallel call "
                "(NUMBA_THREADING_LAYER=workqueue, or 'tbb' with the tbb package installed).")
        if not _layer_started():
            numba.get_num_threads()  # starts the threading layer: now threading_layer() answers
        self._held = None
        if numba.threading_layer() == "workqueue":
            self._held = _lock  # the one acquired (a fork in between replaces _lock)
            self._held.acquire()
        return self

    def __exit__(self, *exc):
        if self._held is not None:
            self._held.release()
            self._held = None
        return False


def kernel_launch():
    """Around every launch of the parallel CPU kernels from Python: refuses what would crash
    the process and serializes launches where the threading layer is not thread-safe (a
    context manager)."""
    return _KernelLaunch()


def _package_dispatchers():
    """The cached ``@njit`` functions of the CPU kernels' modules (those imported)."""
    from numba.core.registry import CPUDispatcher

    for name, module in list(sys.modules.items()):
        if not name.startswith("sdpa_numba.cpu") or module is None:
            continue
        for obj in list(vars(module).values()):
            if isinstance(obj, CPUDispatcher) and hasattr(getattr(obj, "_cache", None),
                                                          "_cache_file"):
                yield obj


_package_stamp = None


def package_stamp():
    """A hash of the contents of every ``.py`` file of the package (once per process)."""
    global _package_stamp
    if _package_stamp is None:
        root = os.path.dirname(os.path.abspath(__file__))
        h = hashlib.sha256()
        for folder, dirs, files in os.walk(root):
            dirs[:] = sorted(d for d in dirs if d != "__pycache__")
            for name in sorted(f for f in files if f.endswith(".py")):
                path = os.path.join(folder, name)
                h.update(os.path.relpath(path, root).encode())
                with open(path, "rb") as f:
                    h.update(hashlib.sha256(f.read()).digest())
        _package_stamp = "sdpa_numba:" + h.hexdigest()
    return _package_stamp


def stamp_caches():
    """Give every cached kernel of the package the package's stamp (:func:`package_stamp`) in
    place of its own file's modification time and size, before anything loads or saves it.

    Numba keys a cache entry on the function's own bytecode and checks its index against its
    own file's stamp, but the kernels inline helpers from other modules (the score seam, the
    micro-kernel, tanh): edited alone, those would leave the kernels' caches "fresh" with old
    machine code in them. Idempotent; cheap after the first call.
    """
    stamp = package_stamp()
    for d in _package_dispatchers():
        d._cache._cache_file._source_stamp = stamp


def _discard_corrupt_caches():
    """Empty the index of every cache whose index or data files do not load; return the
    index files discarded."""
    discarded = []
    seen = set()
    for d in _package_dispatchers():
        if id(d) in seen:
            continue
        seen.add(id(d))
        cache_file = d._cache._cache_file
        try:
            for data_name in cache_file._load_index().values():
                cache_file._load_data(data_name)
        except FileNotFoundError:
            pass  # Numba treats a missing data file as a cache miss
        except Exception:  # noqa: BLE001 - any file that does not load is unusable
            discarded.append(cache_file._index_path)
            d._cache.flush()  # an empty index: the stale data files get overwritten
    return discarded


def _from_cache_save(exc):
    """Whether ``exc`` was raised while Numba wrote a cache file."""
    return any(frame.name == "save_overload" and frame.filename.endswith("caching.py")
               for frame in traceback.extract_tb(exc.__traceback__))


def _skip_save(sig, data):
    """Stands in for a cache's ``save_overload`` once writing the cache has failed."""


def compile_entry(dispatcher, sig):
    """``dispatcher.compile(sig)``, robust to the on-disk cache: a corrupt cache file is
    discarded and the function recompiled; a cache that cannot be written (a full disk) is
    no longer written to. Both with a warning, instead of failing this and every later call.
    """
    stamp_caches()  # kernel modules imported after the package's first stamping
    try:
        dispatcher.compile(sig)
    except OSError as e:
        if not _from_cache_save(e):
            raise
        # Numba registers a compiled function before saving it: what compiled is kept.
        warnings.warn(f"sdpa_numba: cannot write Numba's cache ({e}); the CPU kernels "
                      f"compiled from now on are not cached", RuntimeWarning, stacklevel=3)
        for d in _package_dispatchers():
            d._cache.save_overload = _skip_save
        dispatcher.compile(sig)
    except Exception:
        discarded = _discard_corrupt_caches()
        if not discarded:
            raise
        warnings.warn(f"sdpa_numba: discarded unreadable Numba cache files {discarded} "
                      f"(truncated or corrupt); recompiling", RuntimeWarning, stacklevel=3)
        dispatcher.compile(sig)
    return dispatcher.overloads[sig].entry_point


def caching_available(probe):
    """Whether Numba can cache the functions of ``probe``'s source directory; warns if not."""
    if config.DISABLE_JIT:
        return False
    from numba.core.caching import FunctionCache

    try:
        FunctionCache(probe)
    except RuntimeError as e:
        if "no locator available" not in str(e):
            raise
        warnings.warn(
            "sdpa_numba: Numba can write its cache nowhere (not next to the package, nor "
            "under NUMBA_CACHE_DIR or the user's cache directory): the CPU kernels are "
            "compiled without caching, in every new process. Point NUMBA_CACHE_DIR at a "
            "writable directory to cache them.", RuntimeWarning, stacklevel=2)
        return False
    return True
