"""The asv suite (asv_bench/) must run: a broken benchmark fails CI, not the next asv run.

Every benchmark class is imported from the working tree, set up with its smallest parameters
(the first value of each list) and each of its benchmark methods is called once; nothing is
timed or compared against a speed. CUDA benchmarks must skip themselves with a reason where
they cannot run. ``asv check`` (signatures, parameters) runs too when asv is installed.
"""

import importlib.util
import inspect
import json
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
ASV_DIR = ROOT / "asv_bench"
BENCH_DIR = ASV_DIR / "benchmarks"
PACKAGE = "_sdpa_numba_asv_benchmarks"  # a name that clashes with no test package
PREFIXES = ("time_", "timeraw_", "track_", "peakmem_", "mem_")


def _load_suite():
    spec = importlib.util.spec_from_file_location(
        PACKAGE, BENCH_DIR / "__init__.py", submodule_search_locations=[str(BENCH_DIR)])
    pkg = importlib.util.module_from_spec(spec)
    sys.modules[PACKAGE] = pkg
    spec.loader.exec_module(pkg)
    modules = {}
    for path in sorted(BENCH_DIR.glob("*.py")):
        if path.stem != "__init__":
            modules[path.stem] = importlib.import_module(f"{PACKAGE}.{path.stem}")
    return modules


MODULES = _load_suite()
CLASSES = [(f"{mod}.{name}", cls) for mod, m in MODULES.items()
           for name, cls in vars(m).items()
           if inspect.isclass(cls) and cls.__module__ == m.__name__ and not name.startswith("_")
           and any(a.startswith(PREFIXES) for a in dir(cls))]


def test_the_suite_has_what_issue_5_asks_for():
    names = {n for n, _ in CLASSES}
    assert {"cpu_forward.Forward", "cpu_forward.PeakMemory", "compile_time.CompileTime",
            "cuda_forward.CudaForward"} <= names
    methods = {m for _, c in CLASSES for m in dir(c) if m.startswith(PREFIXES)}
    assert {"time_forward", "track_gflops", "peakmem_forward", "track_first_call_cold",
            "track_first_call_cached"} <= methods


def test_the_suite_has_the_backward_issue_6_asks_for():
    names = {n for n, _ in CLASSES}
    assert {"cpu_backward.Backward", "cuda_forward.CudaBackward"} <= names
    methods = {m for n, c in CLASSES if "Backward" in n for m in dir(c)}
    assert {"time_backward", "track_gflops"} <= methods


@pytest.mark.parametrize("name,cls", CLASSES, ids=[n for n, _ in CLASSES])
def test_benchmark_runs_once_with_smallest_params(name, cls, tmp_path, monkeypatch):
    params = getattr(cls, "params", [])
    if params and not isinstance(params[0], (list, tuple)):
        params = [params]
    if params:
        assert len(cls.param_names) == len(params)
    args = [p[0] for p in params]
    bench = cls()
    cached = ()
    if hasattr(bench, "setup_cache"):
        monkeypatch.chdir(tmp_path)  # asv runs setup_cache in a folder of its own
        cached = (bench.setup_cache(),)
    try:
        if hasattr(bench, "setup"):
            bench.setup(*cached, *args)
    except NotImplementedError as exc:
        assert name.startswith("cuda_"), f"{name} skipped itself: {exc}"
        pytest.skip(f"{name}: {exc}")
    for attr in sorted(a for a in dir(bench) if a.startswith(PREFIXES)):
        value = getattr(bench, attr)(*cached, *args)
        if attr.startswith("track_"):
            assert isinstance(value, (int, float)) and value > 0, (attr, value)
    if hasattr(bench, "teardown"):
        bench.teardown(*cached, *args)


def test_cuda_benchmarks_skip_with_a_reason_without_a_gpu():
    mod = MODULES["cuda_forward"]
    if mod.SKIP_REASON is None:
        pytest.skip("a CUDA driver and sdpa_numba.gpu are present: the benchmark may run")
    with pytest.raises(NotImplementedError, match="sdpa_numba.gpu|CUDA|GPU"):
        mod.CudaForward().setup(1024, 64, False, "float32")


def test_asv_conf_is_valid_json_pointing_at_the_repo():
    text = (ASV_DIR / "asv.conf.json").read_text()
    conf = json.loads("\n".join(line for line in text.splitlines()
                                if not line.lstrip().startswith("//")))
    assert conf["repo"] == ".." and conf["benchmark_dir"] == "benchmarks"
    assert conf["environment_type"] == "virtualenv"


def test_asv_check():
    if importlib.util.find_spec("asv") is None:
        pytest.skip("asv is not installed (pip install -e '.[bench]')")
    cmd = [sys.executable, "-m", "asv", "check", "-E", f"existing:{sys.executable}"]
    proc = subprocess.run(cmd, cwd=ASV_DIR, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "No problems found" in proc.stdout, proc.stdout + proc.stderr
