"""The decode presets of ``python -m sdpa_numba bench`` (tiny cases: the command runs, its
figures are consistent; speed itself is never a pass/fail test)."""

import json

from sdpa_numba import cli
from sdpa_numba.bench import decode as bench_decode
from sdpa_numba.bench.decode import DecodeCase

SMALL = [DecodeCase(1, 4, 2, 40, 8), DecodeCase(1, 1, 1, 16, 8, tiny=True),
         DecodeCase(2, 2, 1, 37, 8, page_size=5), DecodeCase(3, 2, 2, 300, 8, ragged=True),
         DecodeCase(1, 1, 1, 70, 8, one_thread=True)]


def test_decode_preset_runs_and_reports_bandwidth(capsys, monkeypatch):
    monkeypatch.setitem(bench_decode.PRESETS, "decode", SMALL)
    monkeypatch.setattr(bench_decode, "TINY_CALLS", 3)
    monkeypatch.setattr(bench_decode, "IDLE", 0.001)
    real_read = bench_decode.read_bandwidth
    monkeypatch.setattr(bench_decode, "read_bandwidth", lambda: real_read(1 << 20, 2))
    monkeypatch.setattr(bench_decode, "READ_BYTES", 1 << 20)
    assert real_read(1 << 20, 1, threads=2) > 0  # two threads, each half
    code = cli.main(["bench", "--preset", "decode", "--repeats", "1", "--pause", "0", "--json"])
    assert code == cli.EXIT_OK
    doc = json.loads(capsys.readouterr().out)
    assert doc["read_bytes_per_s"] > 0
    assert [r["case"] for r in doc["decode"]] == [c.label for c in SMALL]
    for r, c in zip(doc["decode"], SMALL):
        assert r["kv_bytes"] == 2 * c.heads_kv * int(c.lengths().sum()) * c.dim * 4
        t = r["time_s"]["sdpa_numba"]
        assert abs(r["gb_per_s"]["sdpa_numba"] - c.kv_bytes / t / 1e9) < 1e-9
        # the share of the read is against the read timed with the case (tiny: the one before)
        assert set(r["time_s"]) <= {"sdpa_numba", "sdpa_numba 1 thread", "torch"}
        assert r["read_bytes_per_s"] > 0
        share = r["of_read_bandwidth"] * r["read_bytes_per_s"] * t
        assert abs(share - c.kv_bytes) < 1e-6 * c.kv_bytes
        assert c.tiny == (r["read_bytes_per_s"] == doc["read_bytes_per_s"])
        if "torch" in r["time_s"]:
            assert r["rel_err_vs_torch"] < 1e-5  # paged, ragged (torch: masked) agree too
        assert ("speedup_vs_one_thread" in r) == c.one_thread
    code = cli.main(["bench", "--preset", "decode", "--repeats", "1", "--pause", "0"])
    text = capsys.readouterr().out
    assert code == cli.EXIT_OK and "NumPy streaming read" in text and "tiny B1 H1" in text


def test_decode_preset_is_a_choice():
    args = cli.build_parser().parse_args(["bench", "--preset", "decode"])
    assert cli._decode_cases(args) == bench_decode.DECODE
    assert cli._bench_cases(args) == []
    args = cli.build_parser().parse_args(["bench", "--preset", "decode-more"])
    assert cli._decode_cases(args) == bench_decode.DECODE_MORE
    assert [int(n) for n in DecodeCase(4, 1, 1, 8192, 8, ragged=True).lengths()] == [
        128, 2816, 5504, 8192]


def test_decode_quant_preset_reports_the_float_caches_and_error(capsys, monkeypatch):
    small = [DecodeCase(1, 4, 2, 40, 32, quant=f) for f in ("int8", "q8_0", "e4m3fn")]
    monkeypatch.setitem(bench_decode.PRESETS, "decode-quant", small)
    real_read = bench_decode.read_bandwidth
    monkeypatch.setattr(bench_decode, "read_bandwidth", lambda: real_read(1 << 20, 2))
    monkeypatch.setattr(bench_decode, "READ_BYTES", 1 << 20)
    code = cli.main(["bench", "--preset", "decode-quant", "--repeats", "1", "--pause", "0",
                     "--json"])
    assert code == cli.EXIT_OK
    doc = json.loads(capsys.readouterr().out)
    # bytes of 8-bit values and their scales: int8 one float32 scale a token and head, q8_0
    # a float16 one per 32 values, fp8 none
    assert [r["kv_bytes"] for r in doc["decode"]] == [40 * 2 * (64 + 8), 40 * 2 * (64 + 4),
                                                       40 * 2 * 64]
    for r in doc["decode"]:
        t = r["time_s"]
        assert r["speed_vs_float32_cache"] == t["float32 cache"] / t["sdpa_numba"]
        assert r["speed_vs_float16_cache"] == t["float16 cache"] / t["sdpa_numba"]
        assert 0 < r["rel_err_vs_float32_cache"] < 0.1
    code = cli.main(["bench", "--preset", "decode-quant", "--repeats", "1", "--pause", "0"])
    text = capsys.readouterr().out
    assert code == cli.EXIT_OK and "vs float16 cache" in text and "q8_0 cache" in text
