"""The varlen preset of ``python -m sdpa_numba bench`` (a tiny batch: the command runs, its
figures are consistent; speed itself is never a pass/fail test)."""

import json

import numpy as np

from sdpa_numba import cli
from sdpa_numba.bench import varlen as bench_varlen


def test_varlen_preset_runs_and_compares_with_torch(capsys, monkeypatch):
    # float64 and small: the specializations test_varlen compiles
    monkeypatch.setattr(bench_varlen, "lengths", lambda: np.array([3, 0, 40, 1]))
    monkeypatch.setattr(bench_varlen, "HEADS", 2)
    monkeypatch.setattr(bench_varlen, "DIM", 8)
    monkeypatch.setattr(bench_varlen, "DTYPE", "float64")
    code = cli.main(["bench", "--preset", "varlen", "--repeats", "1", "--pause", "0",
                     "--json"])
    assert code == cli.EXIT_OK
    res = json.loads(capsys.readouterr().out)["varlen"]
    assert res["lengths"] == [3, 0, 40, 1]
    for name in ("forward", "backward"):
        r = res[name]
        assert r["time_s"]["sdpa_numba"] > 0
        if "torch loop" in r["time_s"]:
            best = min(r["time_s"]["torch padded"], r["time_s"]["torch loop"])
            assert abs(r["speed_vs_torch"] - best / r["time_s"]["sdpa_numba"]) < 1e-9
            assert r["rel_err_vs_torch"] < 1e-12  # float64: the same answer as torch
    code = cli.main(["bench", "--preset", "varlen", "--repeats", "1", "--pause", "0"])
    assert code == cli.EXIT_OK and "faster torch way" in capsys.readouterr().out


def test_varlen_preset_runs_alone():
    parser = cli.build_parser()
    args = parser.parse_args(["bench", "--preset", "varlen", "--preset", "headline"])
    try:
        cli.cmd_bench(args)
    except SystemExit as e:
        assert e.code == 2
    else:
        raise AssertionError("--preset varlen with another preset must be refused")
