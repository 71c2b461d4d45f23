"""The command line (``python -m sdpa_numba``): exit codes and the shape of its output.

Tiny sizes and float32 only (one compiled specialization, shared with the other tests through
Numba's cache). Most tests call :func:`sdpa_numba.cli.main` in-process; a few run the module
as a script to check what a shell sees.
"""

import json
import re
import subprocess
import sys

import numpy as np
import pytest

import sdpa_numba
from sdpa_numba import bench, cli

TINY_CHECK = ["check", "-L", "33", "-S", "47", "--heads", "2", "-E", "16", "--repeats", "1"]
TINY_BENCH = ["bench", "--heads", "2", "-E", "16", "--repeats", "1", "--no-progress", "--pause",
              "0"]


def _no_nan_literals(name):
    raise AssertionError(f"{name} in the JSON output: not strict JSON")


def run_json(capsys, argv):
    rc = cli.main(argv)
    return rc, json.loads(capsys.readouterr().out, parse_constant=_no_nan_literals)


def test_check_passes_and_reports_error_time_and_gflops(capsys):
    rc, doc = run_json(capsys, TINY_CHECK + ["--causal", "--json"])
    assert rc == cli.EXIT_OK
    assert doc["ok"] is True
    assert doc["problem"] == {"batch": 1, "heads": 2, "seq": 33, "kv_seq": 47, "dim": 16,
                              "dtype": "float32", "causal": True}
    assert 0 <= doc["rel_err_out"] <= 1e-5 and 0 <= doc["rel_err_lse"] <= 1e-5
    assert doc["tolerance"] == 1e-5
    assert doc["time_s"] > 0 and doc["gflops"] > 0 and doc["first_call_s"] > 0
    assert doc["flops"] == 4 * 2 * 33 * 47 * 16 // 2


def test_check_bfloat16(capsys):
    pytest.importorskip("ml_dtypes")
    rc, doc = run_json(capsys, TINY_CHECK + ["--dtype", "bfloat16", "--json"])
    assert rc == cli.EXIT_OK and doc["ok"] is True
    assert doc["tolerance"] == 4e-3 and 0 < doc["rel_err_out"] <= 4e-3
    assert doc["rel_err_lse"] <= 1e-5


def test_check_text_output(capsys):
    assert cli.main(TINY_CHECK) == cli.EXIT_OK
    text = capsys.readouterr().out
    assert "relative Frobenius error" in text and "GFLOP/s" in text
    assert text.rstrip().endswith("OK")


def test_check_fails_with_exit_1_on_a_wrong_result(capsys, monkeypatch):
    real = sdpa_numba.scaled_dot_product_attention

    def off_by_a_bit(*args, **kwargs):
        res = real(*args, **kwargs)
        if isinstance(res, tuple):
            return res[0] * np.float32(1.001), res[1]
        return res * np.float32(1.001)

    monkeypatch.setattr(sdpa_numba, "scaled_dot_product_attention", off_by_a_bit)
    assert cli.main(TINY_CHECK) == cli.EXIT_FAILED
    assert "FAILED" in capsys.readouterr().out


def test_check_fails_on_nan(capsys, monkeypatch):
    real = sdpa_numba.scaled_dot_product_attention

    def nan_out(*args, **kwargs):
        res = real(*args, **kwargs)
        (res[0] if isinstance(res, tuple) else res)[0, 0, 0, 0] = np.nan
        return res

    monkeypatch.setattr(sdpa_numba, "scaled_dot_product_attention", nan_out)
    rc, doc = run_json(capsys, TINY_CHECK + ["--json"])
    assert rc == cli.EXIT_FAILED and doc["ok"] is False
    assert doc["rel_err_out"] is None  # NaN, written as null


def test_no_arguments_runs_check_with_the_default_problem(monkeypatch):
    seen = {}

    def fake_check(args):
        seen["args"] = args
        return 0

    monkeypatch.setattr(cli, "cmd_check", fake_check)
    assert cli.main([]) == 0
    a = seen["args"]
    assert (a.batch, a.heads, a.seq, a.kv_seq, a.dim, a.dtype, a.causal) == (
        1, 8, 1024, None, 64, "float32", False)


def test_bench_json(capsys):
    rc, doc = run_json(capsys, TINY_BENCH + ["-L", "32", "65", "--causal", "both", "--json",
                                             "--sgemm", "--sgemm-size", "256"])
    assert rc == cli.EXIT_OK
    res = doc["results"]
    assert [(r["seq"], r["causal"]) for r in res] == [(32, False), (65, False), (32, True),
                                                       (65, True)]
    impls = {"sdpa_numba", "numpy"} | ({"torch"} if bench.torch_available() else set())
    for r in res:
        assert set(r["time_s"]) == impls == set(r["gflops"])
        assert all(t > 0 for t in r["time_s"].values())
        assert r["flops"] == 4 * 2 * r["seq"] ** 2 * 16 // (2 if r["causal"] else 1)
        assert r["speed_vs_numpy"] > 0
        if "torch" in impls:
            assert r["rel_err_vs_torch"] < 1e-4
    assert "first_call_s" in res[0]
    assert doc["sgemm_gflops"]["numpy"] > 0
    assert doc["info"]["versions"]["sdpa_numba"] == sdpa_numba.__version__


def test_bench_runs_summarizes_every_run(capsys):
    rc, doc = run_json(capsys, TINY_BENCH + ["-L", "32", "--causal", "both", "--json",
                                             "--runs", "3", "--sgemm", "--sgemm-size", "128"])
    assert rc == cli.EXIT_OK
    assert len(doc["runs"]) == 3
    assert doc["runs"][-1]["results"] == doc["results"]
    assert all(len(run["results"]) == 2 and run["sgemm_gflops"]["numpy"] > 0
               for run in doc["runs"])
    rc = cli.main(TINY_BENCH + ["-L", "32", "--causal", "both", "--runs", "2", "--markdown"])
    text = capsys.readouterr().out
    assert rc == cli.EXIT_OK
    summary = text.split("over 2 runs")[1].strip().splitlines()
    assert summary[1].startswith("| case | vs torch")
    assert len([line for line in summary if line.startswith("| B1 H2 L32 D16")]) == 2, text
    # median (min-max) of GFLOP/s in every row
    assert all(re.search(r"\d \(\d+\.\d-\d+\.\d\)", line)
               for line in summary if line.startswith("| B"))


def test_bench_table_and_plot(capsys, tmp_path):
    pytest.importorskip("matplotlib", reason="--plot needs matplotlib (the bench or docs extra)")
    png = tmp_path / "gflops.png"
    rc = cli.main(TINY_BENCH + ["-L", "16", "32", "--causal", "no", "--impl", "sdpa_numba",
                                "numpy", "--plot", str(png)])
    assert rc == cli.EXIT_OK
    lines = capsys.readouterr().out.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("case"))
    assert "sdpa_numba ms" in lines[header] and "numpy ms" in lines[header]
    assert "torch ms" not in lines[header]
    assert lines[header + 2].startswith("B1 H2 L16 D16 float32")
    assert lines[header + 3].startswith("B1 H2 L32 D16 float32")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert png.stat().st_size > 10_000


def test_bench_markdown_table(capsys):
    assert cli.main(TINY_BENCH + ["-L", "16", "--causal", "yes", "--impl", "sdpa_numba",
                                  "numpy", "--markdown"]) == cli.EXIT_OK
    lines = [x for x in capsys.readouterr().out.splitlines() if x.startswith("|")]
    assert lines[0] == ("| case | sdpa_numba ms | GFLOP/s | numpy ms | GFLOP/s | vs numpy |")
    assert lines[1] == "| --- | ---: | ---: | ---: | ---: | ---: |"
    assert lines[2].startswith("| B1 H2 L16 D16 float32 causal | ") and len(lines) == 3


def test_bench_exit_1_when_results_disagree_with_torch(capsys, monkeypatch):
    pytest.importorskip("torch")
    from sdpa_numba.bench import dense

    real = dense.prepare

    def wrong(impl, case, q, k, v):
        fn = real(impl, case, q, k, v)
        return (lambda: fn() * 2) if impl == "sdpa_numba" else fn

    monkeypatch.setattr(dense, "prepare", wrong)
    rc = cli.main(TINY_BENCH + ["-L", "16", "--causal", "no", "--impl", "sdpa_numba", "torch"])
    assert rc == cli.EXIT_FAILED
    assert "disagree" in capsys.readouterr().err


def test_bench_cases_selection():
    parser = cli.build_parser()
    args = parser.parse_args(["bench", "--preset", "headline"])
    assert cli._bench_cases(args) == [
        bench.Case(1, 8, 2048, 64, "float32", False), bench.Case(1, 8, 2048, 64, "float32", True),
        bench.Case(1, 4, 4096, 128, "float32", False)]
    args = parser.parse_args(["bench", "--case", "2x4x100x32:float64:causal", "--case", "1x1x8x8"])
    assert cli._bench_cases(args) == [bench.Case(2, 4, 100, 32, "float64", True),
                                      bench.Case(1, 1, 8, 8, "float32", False)]
    args = parser.parse_args(["bench", "-L", "64", "128", "-E", "64", "128", "--dtype",
                              "float16", "float32", "--causal", "yes"])
    cases = cli._bench_cases(args)
    assert len(cases) == 8 and all(c.causal for c in cases)
    assert bench.Case(1, 8, 128, 128, "float16", True) in cases


@pytest.mark.parametrize("argv", [
    ["nope"],
    ["check", "--dtype", "int8"],
    ["check", "-L", "0"],
    ["check", "--heads", "two"],
    ["check", "--tol", "-1"],
    ["check", "--threads", "100000"],
    ["bench", "--case", "1x8x2048"],
    ["bench", "--case", "1x8x2048x64:int8"],
    ["bench", "--impl", "jax"],
    ["bench", "--plot", "out.svg"],
    ["bench", "--causal", "maybe"],
    ["bench", "--pause", "-1"],
    ["bench", "--json", "--markdown"],
])
def test_usage_errors_exit_2(argv, capsys):
    assert cli.main(argv) == cli.EXIT_USAGE
    err = capsys.readouterr().err
    assert "usage:" in err and "error:" in err


def test_unexpected_error_exits_3(capsys, monkeypatch):
    def boom(*args, **kwargs):
        raise RuntimeError("kaboom")

    monkeypatch.setattr(sdpa_numba, "scaled_dot_product_attention", boom)
    assert cli.main(TINY_CHECK) == cli.EXIT_ERROR
    assert "kaboom" in capsys.readouterr().err


def test_info(capsys):
    rc, doc = run_json(capsys, ["info", "--json"])
    assert rc == cli.EXIT_OK
    assert doc["versions"]["sdpa_numba"] == sdpa_numba.__version__
    assert doc["versions"]["numba"] and doc["versions"]["llvmlite"] and doc["versions"]["numpy"]
    assert doc["threads"] >= 1 and doc["threading_layer"] in ("tbb", "omp", "workqueue")
    assert isinstance(doc["cpu"]["avx512f"], bool) and doc["cpu"]["name"]
    assert isinstance(doc["cuda"]["usable"], bool) and doc["cuda"]["detail"]
    assert cli.main(["info"]) == cli.EXIT_OK
    text = capsys.readouterr().out
    assert "numba" in text and "avx512f" in text and "cuda" in text


def test_warmup_fills_the_cache_and_info_lists_it(capsys):
    # float32 without a mask: the specializations the rest of the suite compiles anyway.
    rc, doc = run_json(capsys, ["warmup", "--mask", "none", "--json"])
    assert rc == cli.EXIT_OK
    got = {(d["kernel"], d["dtype"], d["mask"], d["dropout"]) for d in doc["specializations"]}
    assert got == {("forward", "float32", "none", False), ("backward", "float32", "bool", False)}
    assert all(d["cached"] for d in doc["specializations"])
    rc, info = run_json(capsys, ["info", "--json"])
    assert {"forward float32, mask none", "backward float32, mask bool"} <= set(info["cached"])


def test_warmup_choices():
    from sdpa_numba.cpu.specializations import specializations

    specs = specializations(["float16", "float64"], ["none", "bool", "additive"], (False, True))
    assert len(specs) == 2 * (3 * 2 + 2)  # the backward's none and bool masks are one kernel
    assert len({str(s) for s in specs}) == len(specs)
    assert cli.main(["warmup", "--mask", "other"]) == cli.EXIT_USAGE


def _module(*argv):
    return subprocess.run([sys.executable, "-m", "sdpa_numba", *argv], capture_output=True,
                          text=True, timeout=300)


def test_python_dash_m_exit_codes():
    p = _module("--version")
    assert p.returncode == 0 and sdpa_numba.__version__ in p.stdout
    p = _module("bench", "--dtype", "float8")
    assert p.returncode == 2 and "invalid choice" in p.stderr
    p = _module(*TINY_CHECK)
    assert p.returncode == 0, p.stdout + p.stderr
    assert p.stdout.rstrip().endswith("OK")
