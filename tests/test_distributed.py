"""Ring attention over MPI: ``mpiexec -n 1/2/3/4`` runs of tests/mpi_ring_worker.py.

The worker shards the same full inputs on every rank, runs ``ring_attention`` and
``ring_attention_backward``, gathers the shards and compares them (rank 0) with the
single-process dense functions on the full arrays; it also records what every rank raised in
the error cases. One mpiexec run per communicator size (oversubscribed on small machines, one
thread per rank), whose JSON report the tests below read. The kernels are compiled (or loaded
from Numba's cache) once here first, so that the ranks load them from the same on-disk cache.

Skipped, saying why, only when mpi4py is not installed (the ``mpi`` and ``test`` extras bring
it and the MPICH wheel, whose ``mpiexec`` lies next to the interpreter).
"""

import json
import os
import pathlib
import shutil
import subprocess
import sys

import numpy as np
import pytest

pytest.importorskip("mpi4py", reason="ring attention needs mpi4py: pip install -e '.[mpi]'")

from sdpa_numba import distributed  # noqa: E402
from sdpa_numba.distributed import mpi  # noqa: E402
from sdpa_numba.distributed.steps import step_work  # noqa: E402
from sdpa_numba.score.recipe import NO_LIMIT  # noqa: E402

from ring_cases import (ERRORS, check_case, check_error,  # noqa: E402
                        check_failing_rank_named, check_refused_everywhere, warm)

ROOT = pathlib.Path(__file__).resolve().parents[1]
WORKER = ROOT / "tests" / "mpi_ring_worker.py"
SIZES = (1, 2, 3, 4)
#: The worker's cases (name -> dtype), checked against its report so none goes missing.
CASES = {
    "f64-causal-contiguous": "float64", "f64-noncausal-contiguous-S7": "float64",
    "f64-causal-zigzag-gqa": "float64", "f64-causal-zigzag-2d": "float64",
    "f64-noncausal-zigzag-bcast": "float64", "f32-causal-zigzag": "float32",
    "f32-noncausal-zigzag-gqa": "float32", "f32-causal-contiguous-gqa": "float32",
    "f16-causal-zigzag": "float16",
    "f64-var-causal-zigzag-window-softcap-sinks": "float64",
    "f64-var-causal-contiguous-alibi-bottomright": "float64",
    "f64-var-zigzag-window-alibi-sinks-L>S": "float64",
}
def mpiexec():
    """The venv's mpiexec (the MPICH wheel installs it next to the interpreter), else PATH's."""
    here = pathlib.Path(sys.executable).parent / "mpiexec"
    if here.exists():
        return str(here)
    found = shutil.which("mpiexec")
    if found is None:
        pytest.fail("mpi4py is installed but no mpiexec was found next to the interpreter "
                    f"({here}) or on PATH: install the MPICH wheel (pip install mpich)")
    return found


def run_ranks(n, tmp_path, timeout=240, threads=1, extra=()):
    path = tmp_path / f"ring{n}-{threads}.json"
    cmd = [mpiexec()]
    # One machine: MPICH's launcher forks (no ssh); Open MPI must be told that more ranks
    # than cores is fine.
    cmd += ["-launcher", "fork"] if _is_mpich() else ["--oversubscribe"]
    cmd += ["-n", str(n), sys.executable, str(WORKER), str(path), *extra]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "NUMBA_NUM_THREADS": str(threads),
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env,
                          cwd=ROOT)
    assert proc.returncode == 0, f"{' '.join(cmd)} failed:\n{proc.stdout}\n{proc.stderr}"
    return json.loads(path.read_text())


def _is_mpich():
    from mpi4py import MPI

    return "MPICH" in MPI.Get_library_version()


@pytest.fixture(scope="module")
def reports(tmp_path_factory):
    warm()
    out = {}
    tmp = tmp_path_factory.mktemp("ring")
    for n in SIZES:
        out[n] = run_ranks(n, tmp)
    out["2 ranks x 2 threads"] = run_ranks(2, tmp, threads=2)
    return out


@pytest.mark.parametrize("n", SIZES)
def test_one_thread_per_rank_and_all_cases_ran(reports, n):
    r = reports[n]
    assert r["size"] == n and r["threads"] == 1
    assert set(r["cases"]) == set(CASES)


def test_bitwise_the_same_for_any_thread_count(reports):
    two = reports["2 ranks x 2 threads"]
    assert two["threads"] == 2
    for case in CASES:
        assert two["cases"][case]["sha256"] == reports[2]["cases"][case]["sha256"], case


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("n", SIZES)
def test_gathered_results_equal_single_process(reports, n, case):
    check_case(reports[n]["cases"][case], case, CASES[case], n)


@pytest.mark.parametrize("name", sorted(ERRORS))
@pytest.mark.parametrize("n", SIZES)
def test_every_rank_raises(reports, n, name):
    check_error(reports[n]["errors"], n, name)


@pytest.mark.parametrize("n", SIZES[1:])
def test_other_ranks_name_the_failing_rank(reports, n):
    check_failing_rank_named(reports[n]["errors"], n)


@pytest.mark.parametrize("n", SIZES[1:])
def test_shapes_and_variants_differing_across_ranks_are_refused_everywhere(reports, n):
    check_refused_everywhere(reports[n]["errors"], n)


@pytest.mark.parametrize("n", SIZES)
def test_variants_off_and_communicator_usable_after_errors(reports, n):
    errors = reports[n]["errors"]
    assert errors["variants_off_ok"] == [True] * n
    assert errors["usable_after"] == [True] * n


@pytest.mark.parametrize("n", SIZES)
def test_shard_unshard_round_trip(reports, n):
    assert reports[n]["shard_roundtrip"] == {"contiguous": [True] * n, "zigzag": [True] * n}


# In-process checks (a communicator of size 1 is enough for these).

@pytest.mark.parametrize("layout", distributed.LAYOUTS)
def test_shard_rows_cover_the_sequence_once(layout):
    for P in (1, 2, 3, 5):
        n = 2 * P * 3
        rows = np.concatenate([distributed.shard_rows(n, P, r, layout) for r in range(P)])
        assert sorted(rows.tolist()) == list(range(n))
    assert distributed.shard_rows(8, 2, 0, "zigzag").tolist() == [0, 1, 6, 7]
    assert distributed.shard_rows(8, 2, 1, "zigzag").tolist() == [2, 3, 4, 5]


@pytest.mark.parametrize("n, size, rank, name", [
    (8, 2, 5, "rank"), (8, 2, 2, "rank"), (8, 2, -1, "rank"), (8, 0, 0, "size"),
    (8, -2, 0, "size"), (-4, 2, 0, "n")])
def test_shard_rows_refuse_a_rank_outside_the_communicator(n, size, rank, name):
    # Unchecked, rank 5 of 2 gave rows past the end, rank -1 negative rows, size 0 a
    # ZeroDivisionError.
    with pytest.raises(ValueError, match=rf"^{name} must"):
        distributed.shard_rows(n, size, rank)
    with pytest.raises(ValueError, match=rf"^{name} must"):
        distributed.shard_rows(n, size, rank, "zigzag")


def test_shard_rows_refuse_non_integers():
    for args, name in (((8.0, 2, 0), "n"), ((8, 2.0, 0), "size"), ((8, 2, True), "rank")):
        with pytest.raises(TypeError, match=rf"^{name} must be an integer"):
            distributed.shard_rows(*args)


def test_shard_rows_refuse_uneven_splits():
    with pytest.raises(ValueError, match="does not split into 4 equal parts"):
        distributed.shard_rows(6, 2, 0, "zigzag")
    with pytest.raises(ValueError, match="layout must be one of"):
        distributed.shard_rows(6, 2, 0, "striped")


def _visible(gi, gj, goff, left, right):
    """The global (row, key) pairs a window sees (the dense semantics, written plainly)."""
    d = gi[:, None] + goff - gj[None, :]  # i' - j
    return (d <= left) & (-d <= right)


def _local_visible(nq, nk, offset, left, right):
    return _visible(np.arange(nq), np.arange(nk), offset, left, right)


NL = NO_LIMIT
#: (is_causal-like window (left, right), alignment offset factor, alibi): the work lists'
#: cases. right 0 is causality; goff is size * (n_k - n_q) for bottom-right alignment.
WINDOWS = [(NL, 0), (NL, NL), (2, 0), (0, 0), (3, 1), (NL, 2), (1, NL), (7, 0), (20, 0)]


@pytest.mark.parametrize("layout", distributed.LAYOUTS)
def test_work_lists_see_every_visible_pair_once(layout):
    """Over all ring steps, the (query, key) pairs a rank's dense calls see (with each
    call's offset and window) are exactly the globally visible ones, each once, for windows,
    causality and bottom-right alignment, with and without ALiBi (whose calls must keep the
    true offset); zigzag causal gives every rank the same work at every step (up to the
    diagonal's triangle) and no more calls than before (one per step)."""
    for P in (1, 2, 3, 4):
        for n_q, n_k in ((6, 6), (4, 8), (8, 4)):
            L, S = P * n_q, P * n_k
            for left, right in WINDOWS:
                for bottom in (False, True):
                    goff = S - L if bottom else 0
                    for alibi in (False, True):
                        want = _visible(np.arange(L), np.arange(S), goff, left, right)
                        seen = np.zeros((L, S), int)
                        work = np.zeros((P, P))
                        calls = np.zeros((P, P))
                        for rank in range(P):
                            qrows = distributed.shard_rows(L, P, rank, layout)
                            for t in range(P):
                                src = (rank - t) % P
                                krows = distributed.shard_rows(S, P, src, layout)
                                for qs, ks, o, lf, rt in step_work(
                                        layout, n_q, n_k, P, rank, src, goff, left, right,
                                        alibi):
                                    qi, kj = qrows[qs], krows[ks]
                                    vis = _local_visible(len(qi), len(kj), o, lf, rt)
                                    # Every pair the call sees is visible, at its true offset.
                                    assert np.array_equal(vis & want[np.ix_(qi, kj)], vis)
                                    if alibi:
                                        d = qi[:, None] + goff - kj[None, :]
                                        dl = (np.arange(len(qi))[:, None] + o
                                              - np.arange(len(kj))[None, :])
                                        assert np.array_equal(d[vis], dl[vis])
                                    seen[np.ix_(qi, kj)] += vis
                                    work[rank, t] += vis.sum()
                                    calls[rank, t] += 1
                        case = (layout, P, n_q, n_k, left, right, bottom, alibi)
                        assert np.array_equal(seen, want.astype(int)), case
                        if (layout == "zigzag" and (left, right) == (NL, 0) and n_q == n_k
                                and not alibi):
                            assert np.ptp(work) <= n_q, (case, work)
                            assert calls.max() <= 1, (case, calls)


def test_work_skips_steps_a_narrow_window_leaves_empty():
    # A causal window of 2 keys over shards of 6: only the diagonal and the step before it
    # have work; the other steps compute nothing (the shards still travel).
    P, n = 4, 6
    for rank in range(P):
        steps = [t for t in range(P)
                 if step_work("contiguous", n, n, P, rank, (rank - t) % P, 0, 2, 0, False)]
        assert steps == ([0] if rank == 0 else [0, 1]), (rank, steps)


def test_host_and_device_operands_mixed_are_refused():
    class FakeDevice:
        __cuda_array_interface__ = {}
        shape, ndim, dtype = (2, 4, 8), 3, np.dtype(np.float32)

    q = np.zeros((2, 4, 8), np.float32)
    with pytest.raises(TypeError, match="query on host, key on cuda"):
        distributed.ring_attention(q, FakeDevice(), q)


@pytest.mark.parametrize("value, expected", [("1", True), ("0", False), (" 1 ", True)])
def test_cuda_aware_override(monkeypatch, value, expected):
    monkeypatch.setenv(distributed.CUDA_AWARE_ENV, value)
    assert distributed.mpi_cuda_aware() is expected


def test_cuda_aware_override_refuses_other_values(monkeypatch):
    monkeypatch.setenv(distributed.CUDA_AWARE_ENV, "yes")
    with pytest.raises(ValueError, match="SDPA_NUMBA_MPI_CUDA_AWARE must be 0 or 1"):
        distributed.mpi_cuda_aware()


def test_cuda_aware_detection_without_override(monkeypatch):
    """Unset, the library is asked; MPICH's wheel here is not built with CUDA."""
    from mpi4py import MPI

    monkeypatch.delenv(distributed.CUDA_AWARE_ENV, raising=False)
    query = getattr(MPI, "Query_cuda_support", None)
    try:
        expected = bool(query()) if query is not None else False
    except Exception:  # noqa: BLE001 - a library without the query counts as not CUDA-aware
        expected = False
    assert distributed.mpi_cuda_aware() is expected


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/maps")
def test_mpich_answers_the_cuda_query(monkeypatch):
    """mpi4py 4.1 has no Query_cuda_support: the library's MPIX_Query_cuda_support is
    found and asked (MPICH and Open MPI have it), and mpi_cuda_aware() says what it said."""
    from mpi4py import MPI

    if hasattr(MPI, "Query_cuda_support"):
        pytest.skip("this mpi4py asks the library itself")
    if "MPICH" not in MPI.Get_library_version():
        pytest.skip("MPICH's libmpi is the one known here to export the query")
    answer = mpi._mpix_query_cuda_support()
    assert answer is not None, "MPIX_Query_cuda_support was not found in the loaded libmpi"
    monkeypatch.delenv(distributed.CUDA_AWARE_ENV, raising=False)
    assert distributed.mpi_cuda_aware() is answer


#: The device cases of the worker's ``--cuda`` mode (tiny: the simulator runs every GPU thread
#: in Python) and their tolerances against the host ring and the dense functions.
CUDA_CASES = {"cuda-f64-causal-zigzag-gqa-window-softcap-sinks": 1e-12,
              "cuda-f32-noncausal-contiguous": 1e-5}


def test_cuda_arrays_under_the_simulator(tmp_path):
    """``mpiexec -n 2`` of the worker's ``--cuda`` mode under the CUDA simulator (whose arrays
    are always staged through host buffers): device forward and backward equal the host
    ring's on the same shards, and the gathered results the dense functions'."""
    path = tmp_path / "ring-cuda.json"
    cmd = [mpiexec(), *(["-launcher", "fork"] if _is_mpich() else ["--oversubscribe"]),
           "-n", "2", sys.executable, str(WORKER), str(path), "--cuda"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "NUMBA_NUM_THREADS": "1",
           "NUMBA_ENABLE_CUDASIM": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    env.pop(distributed.CUDA_AWARE_ENV, None)
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env, cwd=ROOT)
    assert proc.returncode == 0, f"{' '.join(cmd)} failed:\n{proc.stdout}\n{proc.stderr}"
    report = json.loads(path.read_text())
    assert report["size"] == 2 and report["simulated"]
    assert set(report["cases"]) == set(CUDA_CASES)
    for case, tol in CUDA_CASES.items():
        ranks = report["cases"][case]
        assert len(ranks) == 2
        for r in ranks:
            assert r["device_results"] and r["inputs_unchanged"], (case, r)
            assert all(kind == "FakeCUDAArray" for kind in r["kinds"][:4]), (case, r)
            assert r["vs_host_ring"] <= tol, (case, r)
            assert r["vs_dense"] <= tol, (case, r)
            if "sinks" in case:
                assert r["dsinks_vs_host_ring"] <= tol, (case, r)


def test_comm_must_be_a_communicator():
    q = np.zeros((2, 4, 8))
    with pytest.raises(TypeError, match="comm must be an mpi4py intracommunicator"):
        distributed.ring_attention(q, q, q, comm="world")


def _ring_garbage(call):
    """What of the ring's (its frames, its objects) a raising ``call`` left in reference
    cycles: such garbage lives until the cyclic collector runs, and on a torch.distributed
    group it kept gloo's objects alive into interpreter shutdown, which aborted the rank
    (tests/test_distributed_torch.py's runs)."""
    import gc
    import types

    gc.collect()
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        try:
            call()
        except (ValueError, RuntimeError):
            pass
        else:
            raise AssertionError("the call did not raise")
        gc.collect()
        return [o for o in gc.garbage
                if type(o).__module__.startswith("sdpa_numba")
                or (isinstance(o, types.FrameType) and "sdpa_numba" in o.f_code.co_filename)]
    finally:
        gc.set_debug(0)
        gc.garbage.clear()


@pytest.mark.parametrize("where", ["input", "forward", "backward"])
def test_a_raising_ring_leaves_no_reference_cycle(monkeypatch, where):
    from sdpa_numba.distributed import ring_backward, ring_forward

    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((2, 6, 8)) for _ in range(3))
    out, lse = distributed.ring_attention(q, k, v, return_lse=True)

    def failing(*args, **kwargs):
        raise RuntimeError("injected failure")

    monkeypatch.setattr(ring_forward, "_attend", failing)
    monkeypatch.setattr(ring_backward, "_attend_backward", failing)
    call = {"input": lambda: distributed.ring_attention(q, k, v[..., :4]),
            "forward": lambda: distributed.ring_attention(q, k, v),
            "backward": lambda: distributed.ring_attention_backward(q, q, k, v, out, lse)}[where]
    assert _ring_garbage(call) == []
