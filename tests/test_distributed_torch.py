"""Ring attention over torch.distributed: 1, 2 and 3 gloo processes of tests/torch_ring_worker.py.

The worker runs tests/ring_cases.py's cases (the MPI ring's: forward and backward,
contiguous and zigzag, causal, GQA, the variants, float64/32/16) on torch CPU tensors with
``comm=torch.distributed.group.WORLD``, and the error cases (bad input on one rank, a rank
failing midway: raised on every rank), and at 3 processes a ring on a subgroup. The ranks are
launched as ``torchrun`` would (``RANK``, ``WORLD_SIZE`` in the environment; here the group
meets through an init file), one Numba thread each, killed if the whole run outlasts its
timeout (a hang fails the test instead of stalling CI). With mpi4py installed, the gathered
results are compared bit for bit with the MPI ring's on the same cases (same kernels, same
merge and accumulation orders).

Skipped, saying why, only when torch or its distributed package is missing (the ``test``
extra brings torch).
"""

import json
import os
import pathlib
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="ring attention over torch.distributed needs "
                                            "torch: pip install -e '.[test]'")
dist = pytest.importorskip("torch.distributed")
if not dist.is_available():  # pragma: no cover - torch built without distributed
    pytest.skip("this torch has no torch.distributed", allow_module_level=True)

from ring_cases import (CASES, ERRORS, check_case, check_error,  # noqa: E402
                        check_failing_rank_named, check_refused_everywhere, warm)

from sdpa_numba import distributed  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[1]
WORKER = ROOT / "tests" / "torch_ring_worker.py"
#: One process first: it compiles (or loads) every kernel the cases use, once, so that the
#: ranks of the larger groups load them from Numba's cache instead of compiling them side by
#: side; and a group of one is plain attention (bitwise).
SIZES = (1, 2, 3)
DTYPES = {case[0]: case[1] for case in CASES}


def launch(n, tmp_path, script, args, timeout):
    """``n`` ranks of ``script`` (``RANK``/``WORLD_SIZE`` set, one thread each); every rank
    is killed when the run outlasts ``timeout`` (then the test fails, with their output)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "NUMBA_NUM_THREADS": "1",
           "WORLD_SIZE": str(n),
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    procs, logs = [], []
    for r in range(n):
        log = open(tmp_path / f"rank{r}-{n}.log", "w+")
        logs.append(log)
        procs.append(subprocess.Popen([sys.executable, str(script), *args],
                                      env={**env, "RANK": str(r)}, cwd=ROOT, stdout=log,
                                      stderr=subprocess.STDOUT, start_new_session=True))
    deadline = time.monotonic() + timeout
    try:
        while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
            time.sleep(0.2)
    finally:
        hung = [r for r, p in enumerate(procs) if p.poll() is None]
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
    output = ""
    for r, log in enumerate(logs):
        log.seek(0)
        output += f"--- rank {r} ---\n{log.read()[-4000:]}\n"
        log.close()
    assert not hung, f"ranks {hung} of {n} still running after {timeout} s:\n{output}"
    codes = [p.returncode for p in procs]
    assert codes == [0] * n, f"exit codes {codes}:\n{output}"


def run_ranks(n, tmp_path, cases=None, timeout=300):
    path = tmp_path / f"torch-ring{n}.json"
    init = tmp_path / f"init{n}"  # gloo's file rendezvous: must not exist yet
    args = [str(path), str(init)] + (["--cases", ",".join(cases)] if cases else [])
    launch(n, tmp_path, WORKER, args, timeout)
    return json.loads(path.read_text())


@pytest.fixture(scope="module")
def reports(tmp_path_factory):
    warm()  # the ranks load the kernels from Numba's on-disk cache
    tmp = tmp_path_factory.mktemp("torch-ring")
    return {n: run_ranks(n, tmp, timeout=900 if n == 1 else 300) for n in SIZES}


@pytest.mark.parametrize("n", SIZES)
def test_gloo_one_thread_per_rank_and_all_cases_ran(reports, n):
    r = reports[n]
    assert r["size"] == n and r["threads"] == 1 and r["backend"] == "gloo"
    assert set(r["cases"]) == set(DTYPES)


@pytest.mark.parametrize("case", sorted(DTYPES))
@pytest.mark.parametrize("n", SIZES)
def test_gathered_results_equal_single_process(reports, n, case):
    # torch tensors in, torch tensors out (out, lse, and the gradients of q, k, v; the
    # sinks' gradient is a NumPy array, as in the dense backward)
    check_case(reports[n]["cases"][case], case, DTYPES[case], n, kinds="Tensor")


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
def test_variants_off_group_usable_after_errors_and_shard_round_trip(reports, n):
    errors = reports[n]["errors"]
    assert errors["variants_off_ok"] == [True] * n
    assert errors["usable_after"] == [True] * n
    assert reports[n]["shard_roundtrip"] == {"contiguous": [True] * n, "zigzag": [True] * n}


def test_ring_on_a_subgroup(reports):
    """Global ranks 1 and 2 of 3 as a group of 2 (messages go to the neighbours' global
    ranks); rank 0 does not take part."""
    got = reports[3]["subgroup"]
    assert got[0] is None
    assert [g["group_rank"] for g in got[1:]] == [0, 1]
    assert all(g["max_err"] <= 1e-12 for g in got[1:]), got


def test_bitwise_equal_to_the_mpi_ring(reports, tmp_path):
    """The same cases under ``mpiexec -n 2``: the gathered results have the same bits as
    over gloo (the transport moves bytes; kernels and orders are the same)."""
    pytest.importorskip("mpi4py", reason="the MPI ring to compare with needs mpi4py")
    from test_distributed import run_ranks as run_mpi_ranks

    mpi = run_mpi_ranks(2, tmp_path, extra=["--cases", ",".join(sorted(DTYPES))])
    assert set(mpi["cases"]) == set(DTYPES)
    for case in DTYPES:
        assert mpi["cases"][case]["sha256"] == reports[2]["cases"][case]["sha256"], case


# In-process checks: a gloo group of one process.

@pytest.fixture
def world(tmp_path):
    if dist.is_initialized():  # pragma: no cover - left by another test
        pytest.skip("torch.distributed is already initialized in this process")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'init'}", rank=0,
                            world_size=1)
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


def test_group_of_one_is_plain_attention_on_tensors(world):
    import sdpa_numba

    rng = np.random.default_rng(3)
    q, k, v = (rng.standard_normal((2, 6, 8)) for _ in range(3))
    out, lse = distributed.ring_attention(*(torch.from_numpy(x) for x in (q, k, v)),
                                          comm=world, is_causal=True, return_lse=True)
    ref, ref_lse = sdpa_numba.scaled_dot_product_attention(q, k, v, is_causal=True,
                                                           return_lse=True)
    assert isinstance(out, torch.Tensor) and isinstance(lse, torch.Tensor)
    assert np.array_equal(out.numpy(), ref) and np.array_equal(lse.numpy(), ref_lse)


def test_a_group_that_cannot_move_host_buffers_is_refused(world, monkeypatch):
    q = torch.zeros(2, 6, 8, dtype=torch.float64)
    for backend in ("nccl", "cuda:nccl"):
        monkeypatch.setattr(dist, "get_backend", lambda group=None, b=backend: b)
        with pytest.raises(NotImplementedError, match="moves host buffers"):
            distributed.ring_attention(q, q, q, comm=world)


def test_comm_none_under_a_torch_world_larger_than_mpis(world, monkeypatch):
    """Under torchrun, MPI's world is one process: comm=None would attend to this rank's
    keys only. Refused, pointing at the group."""
    pytest.importorskip("mpi4py", reason="comm=None means MPI.COMM_WORLD")
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    q = np.zeros((2, 6, 8))
    with pytest.raises(ValueError, match="pass comm=torch.distributed.group.WORLD"):
        distributed.ring_attention(q, q, q)


def test_comm_of_another_kind_is_refused():
    pytest.importorskip("mpi4py", reason="any other comm is taken for an mpi4py one")
    q = np.zeros((2, 4, 8))
    with pytest.raises(TypeError, match="or a torch.distributed ProcessGroup"):
        distributed.ring_attention(q, q, q, comm="world")
