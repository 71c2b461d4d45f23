"""Hardening against what users do around the kernels: missing operands, self-overlapping
``out``, fork after use, threads under the workqueue layer, NUMBA_DISABLE_JIT, a corrupt or
impossible on-disk cache, float16 arrays passed to the jitted entry points.

Whatever depends on process-wide state (threading layer, environment, cache directory) runs
in a subprocess with a timeout, so that a crash or a hang fails the test instead of the suite.
The subprocesses use the specializations the other tests compile (float32, no mask), which
Numba's cache then holds.
"""

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from numpy.lib.stride_tricks import as_strided

from sdpa_numba import reference
from sdpa_numba import scaled_dot_product_attention as sdpa
from sdpa_numba import scaled_dot_product_attention_backward as sdpa_backward
from sdpa_numba.api import may_self_overlap

ROOT = Path(__file__).resolve().parents[1]


def run_python(code, timeout=120, cwd=ROOT, **env):
    """Run ``code`` in a fresh interpreter that imports this checkout (or ``env``'s
    PYTHONPATH, from ``cwd``); returns the CompletedProcess. Numba settings of the caller's
    environment are dropped unless given, except its cache directory: the interpreter loads
    the kernels the suite has compiled instead of compiling them again (tests that need
    another cache give theirs)."""
    full = {k: v for k, v in os.environ.items()
            if not k.startswith("NUMBA_") or k == "NUMBA_CACHE_DIR"}
    full["PYTHONPATH"] = str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")
    full.update(env)
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=full,
                          capture_output=True, text=True, timeout=timeout, cwd=cwd)


def ok(proc):
    assert proc.returncode == 0, f"rc {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    return proc.stdout


# -- operands that are missing -------------------------------------------------------------

def _qkv(rng):
    return [rng.standard_normal((2, 5, 4)).astype(np.float32) for _ in range(3)]


@pytest.mark.parametrize("missing", [(0,), (1,), (2,), (0, 1, 2)])
def test_forward_missing_operand_is_type_error(rng, missing):
    args = _qkv(rng)
    names = ["query", "key", "value"]
    for i in missing:
        args[i] = None
    with pytest.raises(TypeError, match=f"{names[missing[0]]} must be .* got None"):
        sdpa(*args)


def test_missing_operands_do_not_end_a_surrounding_map():
    # A StopIteration would end the map silently, as if it had no items.
    with pytest.raises(TypeError, match="query"):
        list(map(lambda _: sdpa(None, None, None), [0]))


@pytest.mark.parametrize("missing", range(6))
def test_backward_missing_operand_is_type_error(rng, missing):
    q, k, v = _qkv(rng)
    out, lse = sdpa(q, k, v, return_lse=True)
    args = [out, q, k, v, out, lse]  # grad_out, query, key, value, out, lse
    names = ["grad_out", "query", "key", "value", "out", "lse"]
    args[missing] = None
    with pytest.raises(TypeError, match=f"{names[missing]} must be .* got None"):
        sdpa_backward(*args)
    with pytest.raises(TypeError, match="got None"):
        sdpa_backward(None, None, None, None, None, None)


@pytest.mark.filterwarnings("ignore:the matrix subclass:PendingDeprecationWarning")
def test_masked_arrays_and_matrices_are_refused(rng):
    q, k, v = _qkv(rng)
    with pytest.raises(TypeError, match="key is a masked array"):
        sdpa(q, np.ma.masked_array(k, mask=k > 0), v)
    with pytest.raises(TypeError, match="np.matrix"):
        sdpa(np.asmatrix(q[0]), k[0], v[0])


def test_non_native_byte_order_says_so(rng):
    q, k, v = (x.astype(x.dtype.newbyteorder()) for x in _qkv(rng))
    with pytest.raises(TypeError, match="byte order"):
        sdpa(q, k, v)


def test_shapes_too_large_to_address_are_value_errors():
    # Broadcasting two views of a small array makes a batch of 2**62 x (5, 4) outputs.
    x = np.ones((5, 4), np.float32)
    q = np.broadcast_to(x, (2**31, 1, 1, 5, 4))
    kv = np.broadcast_to(x, (1, 2**31, 1, 5, 4))
    with pytest.raises(ValueError, match="output would have shape .* too large"):
        sdpa(q, kv, kv)


# -- out whose elements overlap each other ---------------------------------------------------

def test_out_with_overlapping_rows_is_refused(rng):
    q, k, v = _qkv(rng)  # out: (2, 5, 4) float32
    buf = np.zeros(64, np.float32)
    rows_overlap = as_strided(buf, (2, 5, 4), (5 * 2 * 4, 2 * 4, 4))  # row stride 2 < 4
    with pytest.raises(ValueError, match="overlap each other"):
        sdpa(q, k, v, out=rows_overlap)
    heads_overlap = as_strided(buf, (2, 5, 4), (4 * 4, 4 * 4, 4))  # head stride < a head
    with pytest.raises(ValueError, match="overlap each other"):
        sdpa(q, k, v, out=heads_overlap)
    assert not buf.any()  # nothing written
    # a transposed, sliced buffer with a gap is fine
    big = np.full((4, 8, 6), np.nan, np.float32)
    fine = big[1:3, 1:6, 1:5]
    sdpa(q, k, v, out=fine)
    assert np.isfinite(fine).all() and np.isnan(big[0]).all()


def _overlaps_brute(shape, strides, itemsize):
    starts = {0}
    for n, s in zip(shape, strides):
        starts = {a + i * s for a in starts for i in range(n)}
    if len(starts) < int(np.prod(shape)):
        return True
    ordered = sorted(starts)
    return any(b - a < itemsize for a, b in zip(ordered, ordered[1:]))


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 4), st.integers(-24, 24)), min_size=1, max_size=4),
       st.sampled_from([1, 2, 4, 8]))
def test_self_overlap_test_never_misses_an_overlap(dims, itemsize):
    shape = tuple(n for n, _ in dims)
    strides = tuple(s for _, s in dims)
    if _overlaps_brute(shape, strides, itemsize):
        assert may_self_overlap(shape, strides, itemsize)


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(1, 4), min_size=1, max_size=4), st.randoms(use_true_random=False),
       st.sampled_from([np.float16, np.float32, np.float64]))
def test_self_overlap_test_accepts_views_of_a_buffer(shape, random, dtype):
    a = np.zeros([n + 1 for n in shape], dtype)
    view = a[tuple(slice(None, n) if random.random() < 0.5 else slice(n, 0, -1)
                   for n in shape)]
    order = list(range(len(shape)))
    random.shuffle(order)
    view = view.transpose(order)
    assert not may_self_overlap(view.shape, view.strides, view.itemsize)


# -- fork, threads, NUMBA_DISABLE_JIT --------------------------------------------------------

_FORK_POOL = """
    import multiprocessing as mp
    import numpy as np
    import sdpa_numba

    def work(i):
        q = np.random.default_rng(i).standard_normal((2, 3, 33, 16)).astype(np.float32)
        o, lse = sdpa_numba.scaled_dot_product_attention(q, q, q, return_lse=True)
        g = sdpa_numba.scaled_dot_product_attention_backward(o, q, q, q, o, lse)
        return o, g[0]

    def main():
        parent = [work(i) for i in range(3)]  # the parent uses the kernels before forking
        with mp.get_context("fork").Pool(2) as pool:
            try:
                child = pool.map_async(work, range(3)).get(timeout=60)
            except mp.TimeoutError:
                print("HANG")
                raise SystemExit(3)
            except RuntimeError as e:
                print("ERROR", e)
                raise SystemExit(0)
        assert all(np.array_equal(a, b) for p, c in zip(parent, child) for a, b in zip(p, c))
        print("SAME")
"""


def _fork_pool(tmp_path, **env):
    script = tmp_path / "fork_pool.py"  # a file: the pool pickles `work` by its module's name
    script.write_text(textwrap.dedent(_FORK_POOL))
    return run_python(f"import runpy, sys; sys.argv = [{str(script)!r}]; "
                      f"sys.path.insert(0, {str(tmp_path)!r}); import fork_pool; "
                      f"fork_pool.main()", **env)


def test_fork_pool_after_use_works(tmp_path):
    """Under the threading layer sdpa_numba picks, a fork pool's workers run the kernels."""
    assert ok(_fork_pool(tmp_path)).strip() == "SAME"


def test_fork_pool_after_use_under_gnu_openmp_is_a_clear_error(tmp_path):
    """Where the user chose GNU OpenMP (not fork-safe), the child says so instead of dying."""
    probe = run_python("import numba.np.ufunc.omppool as o; print(o.openmp_vendor)")
    if probe.returncode or probe.stdout.strip() != "GNU":
        pytest.skip("no GNU OpenMP threading layer here")
    out = ok(_fork_pool(tmp_path, NUMBA_THREADING_LAYER="omp"))
    assert out.startswith("ERROR") and "forked" in out and "spawn" in out


#: Eight Python threads calling the forward and backward at once; prints the layer and how
#: many calls differed from the first (run with run_python).
THREADS_SCRIPT = """
    import threading
    import numba
    import numpy as np
    import sdpa_numba

    q = np.random.default_rng(0).standard_normal((2, 3, 65, 16)).astype(np.float32)
    o, lse = sdpa_numba.scaled_dot_product_attention(q, q, q, return_lse=True)
    g = sdpa_numba.scaled_dot_product_attention_backward(o, q, q, q, o, lse)
    bad = []

    def work():
        for _ in range(5):
            o2 = sdpa_numba.scaled_dot_product_attention(q, q, q)
            g2 = sdpa_numba.scaled_dot_product_attention_backward(o, q, q, q, o, lse)
            if not (np.array_equal(o2, o) and np.array_equal(g2[1], g[1])):
                bad.append(1)

    threads = [threading.Thread(target=work) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    print(numba.threading_layer(), "bad", len(bad))
"""


def test_python_threads_under_workqueue_layer():
    """workqueue is not thread-safe: calls from many threads must not abort the process."""
    proc = run_python(THREADS_SCRIPT, NUMBA_THREADING_LAYER="workqueue")
    assert ok(proc).strip() == "workqueue bad 0"


def test_disable_jit_is_a_clear_error():
    proc = run_python("""
        import numpy as np
        import sdpa_numba, sdpa_numba.cpu  # importing works
        q = np.ones((3, 4))
        try:
            sdpa_numba.scaled_dot_product_attention(q, q, q)
        except RuntimeError as e:
            print(e)
    """, timeout=60, NUMBA_DISABLE_JIT="1")
    assert "NUMBA_DISABLE_JIT" in ok(proc)


# -- the on-disk cache ----------------------------------------------------------------------

_FORWARD_CALL = """
    import warnings
    import numpy as np
    import sdpa_numba
    from sdpa_numba import reference

    q = np.random.default_rng(0).standard_normal((2, 3, 9, 8)).astype(np.float32)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = sdpa_numba.scaled_dot_product_attention(q, q, q)
    ref, _ = reference.attention(q, q, q)
    assert np.abs(out - ref).max() < 1e-5
    print("WARN", [str(w.message) for w in caught])
"""


def _copy_cache(rng, tmp_path, leave_out=()):
    """A copy of this process's cache of the CPU kernels, where a subprocess run with
    NUMBA_CACHE_DIR=tmp_path finds it (so that it recompiles only what a test damages)."""
    from numba.core.caching import _CacheLocator

    from sdpa_numba.cpu import forward

    q = rng.standard_normal((2, 3, 9, 8)).astype(np.float32)
    sdpa(q, q, q)  # the specialization the subprocess uses is in this process's cache
    sub = _CacheLocator.get_suitable_cache_subpath(forward.py_func.__code__.co_filename)
    cache = tmp_path / sub
    # Another xdist worker may be saving to the same cache: its temporary files (renamed
    # when written) can vanish mid-copy.
    shutil.copytree(forward._cache.cache_path, cache,
                    ignore=shutil.ignore_patterns("*.py", "*.pyc", "*.tmp.*", "*.lock",
                                                  *leave_out))
    return cache


@pytest.mark.parametrize("damaged", ["index", "data"])
def test_truncated_cache_file_is_recompiled(tmp_path, rng, damaged):
    # The forward's index or data files truncated, as a killed process may leave them.
    cache = _copy_cache(rng, tmp_path)
    pattern = "forward.forward-*.nbi" if damaged == "index" else "forward.forward-*.nbc"
    files = list(cache.glob(pattern))
    assert files
    for f in files:
        f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    out = ok(run_python(_FORWARD_CALL, timeout=300, NUMBA_CACHE_DIR=str(tmp_path)))
    assert "discarded unreadable Numba cache files" in out
    # and the cache is whole again: no warning the next time
    out = ok(run_python(_FORWARD_CALL, timeout=300, NUMBA_CACHE_DIR=str(tmp_path)))
    assert out.strip() == "WARN []"


def test_cached_forward_without_its_row_kernel_in_the_cache(tmp_path, rng):
    # The cached forward calls attend_rows by symbol (cpu/_llvm.by_symbol): with attend_rows's
    # cache entries gone, the subprocess compiles it again, under another name than the one
    # the cached forward was compiled against; the call must still resolve (not abort).
    _copy_cache(rng, tmp_path, leave_out=["forward.attend_rows-*"])
    assert list(tmp_path.rglob("forward.forward-*.nbi"))
    assert not list(tmp_path.rglob("forward.attend_rows-*"))
    code = textwrap.dedent(_FORWARD_CALL) + """
from sdpa_numba.cpu import forward
print("HITS", sum(forward.stats.cache_hits.values()))
"""
    out = ok(run_python(code, timeout=300, NUMBA_CACHE_DIR=str(tmp_path)))
    assert "WARN []" in out and "HITS 1" in out


def test_full_disk_while_saving_the_cache_is_a_warning(tmp_path, rng):
    # Without the forward in the cache, the subprocess compiles it and fails to save it: a
    # file size limit stands in for a full disk (both are OSErrors from write()).
    _copy_cache(rng, tmp_path, leave_out=["forward.forward-*"])
    code = textwrap.dedent(_FORWARD_CALL).replace("import warnings", """import warnings
import resource, signal
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096))""", 1)
    out = ok(run_python(code, timeout=300, NUMBA_CACHE_DIR=str(tmp_path)))
    assert "cannot write Numba's cache" in out


_SOFTMAX_CALL = """
import numpy as np
from sdpa_numba.cpu import online_softmax_update as f
s, v = np.ones((1, 3)), np.ones((3, 2))
m, l, acc = np.full(1, -np.inf), np.zeros(1), np.zeros((1, 2))
f(s, v, m, l, acc)
print(sum(f.stats.cache_hits.values()), sum(f.stats.cache_misses.values()))
"""


def test_editing_a_helper_module_invalidates_the_cached_kernels(tmp_path):
    # Numba checks a cached kernel against its own file only; online_softmax_update inlines
    # exp2 from cpu/exp2.py. A copy of the package, its cache in tmp_path: after an edit of
    # exp2.py alone the kernel must be recompiled, not loaded.
    pkg = tmp_path / "pkg"
    shutil.copytree(ROOT / "sdpa_numba", pkg / "sdpa_numba",
                    ignore=shutil.ignore_patterns("__pycache__"))
    env = dict(PYTHONPATH=str(pkg), NUMBA_CACHE_DIR=str(tmp_path / "cache"))

    def hits_and_misses():
        out = ok(run_python(_SOFTMAX_CALL, timeout=300, cwd=tmp_path, **env))
        return tuple(int(x) for x in out.split()[-2:])

    assert hits_and_misses() == (0, 1)  # compiled and saved
    assert hits_and_misses() == (1, 0)  # unchanged: loaded from the cache
    helper = pkg / "sdpa_numba" / "cpu" / "exp2.py"
    helper.write_text(helper.read_text() + "\n# edited\n")
    assert hits_and_misses() == (0, 1)  # an inlined helper edited: compiled afresh


def test_no_writable_cache_location_compiles_without_cache(tmp_path):
    # A copy of the package whose __pycache__ are files (so nothing can be written next to
    # it, even by root), with HOME, XDG_CACHE_HOME and NUMBA_CACHE_DIR under a regular file.
    pkg = tmp_path / "pkg"
    shutil.copytree(ROOT / "sdpa_numba", pkg / "sdpa_numba",
                    ignore=shutil.ignore_patterns("__pycache__"))
    for d in [pkg / "sdpa_numba", *(p for p in (pkg / "sdpa_numba").rglob("*") if p.is_dir())]:
        (d / "__pycache__").write_text("")
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    proc = run_python("""
        import warnings
        import numpy as np
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            import sdpa_numba
            from sdpa_numba import cpu
        assert sdpa_numba.__file__.startswith(%r), sdpa_numba.__file__
        s = np.array([[0.5, -1.0, 2.0]])
        v = np.array([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]])
        m, l, acc = np.full(1, -np.inf), np.zeros(1), np.zeros((1, 2))
        cpu.online_softmax_update(s, v, m, l, acc)
        out, lse = np.empty((1, 2)), np.empty(1)
        cpu.online_softmax_finalize(m, l, acc, out, lse)
        p = np.exp(s[0] - s[0].max())
        assert np.allclose(out[0], p @ v / p.sum())
        print("WARN", [str(w.message) for w in caught])
    """ % str(pkg), timeout=120, cwd=pkg, PYTHONPATH=str(pkg), HOME=str(blocker / "home"),
        XDG_CACHE_HOME=str(blocker / "cache"), NUMBA_CACHE_DIR=str(blocker / "numba"))
    out = ok(proc)
    assert "compiled without caching" in out


# -- the jitted entry points called from Python ----------------------------------------------

def test_float16_arrays_to_the_cpu_kernels_say_to_pass_uint16(rng):
    from sdpa_numba import cpu

    q = rng.standard_normal((1, 1, 4, 8)).astype(np.float16)
    out = np.empty_like(q)
    lse = np.empty((1, 1, 4), np.float32)
    with pytest.raises(TypeError, match=r"q is a float16 array.*view\(np.uint16\)"):
        cpu.forward(q, q, q, None, False, 1.0, out, lse, None)
    # the uint16 view works, and gives the float16 result
    u = q.view(np.uint16)
    cpu.forward(u, u, u, None, False, 1 / np.sqrt(8), out.view(np.uint16), lse, None)
    ref, _ = reference.attention(q, q, q)
    assert np.abs(out.astype(np.float64) - ref).max() < 2e-3


# -- the command line ------------------------------------------------------------------------

def test_cli_negative_seed_is_a_usage_error(capsys):
    from sdpa_numba import cli

    assert cli.main(["check", "-L", "8", "--seed", "-5"]) == cli.EXIT_USAGE
    assert "--seed: expected a non-negative integer" in capsys.readouterr().err


def test_cli_problem_too_large_for_memory_says_so(capsys):
    from sdpa_numba import cli

    assert cli.main(["check", "-b", "100000", "-L", "100000"]) == cli.EXIT_ERROR
    err = capsys.readouterr().err
    assert "not enough memory" in err and "Traceback" not in err
