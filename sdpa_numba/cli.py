"""The command line: ``python -m sdpa_numba [check|bench|info|warmup] ...``.

* no command, or ``check``: compute one problem (default B1 H8 L1024 D64 float32), compare it
  with the float64 NumPy reference (:func:`sdpa_numba.reference.attention`), print the error,
  the time and GFLOP/s;
* ``bench``: a table of times and GFLOP/s of sdpa_numba, torch's SDPA (when installed) and
  naive NumPy over sizes and dtypes; ``--plot``, ``--json``, ``--sgemm``;
* ``info``: versions, threads, CPU features, CUDA availability, the kernels in Numba's cache;
* ``warmup``: compile chosen kernel specializations into Numba's on-disk cache ahead of time.

Exit codes: 0 success, 1 a check failed (error above tolerance, or bench results that disagree
with torch), 2 bad usage, 3 an unexpected error (its traceback is printed).
"""

import argparse
import json
import math
import sys
import time
import traceback

import numpy as np

from . import bench
from .bench import decode as bench_decode
from .bench import report
from .bench import varlen as bench_varlen
from .problem import flops as count_flops

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_ERROR = 0, 1, 2, 3

#: Relative Frobenius error allowed against the float64 reference.
TOLERANCE = {"float16": 1e-3, "bfloat16": 4e-3, "float32": 1e-5, "float64": 1e-12}
#: Relative error allowed between sdpa_numba and torch in ``bench`` (two rounded results).
AGREEMENT = {"float16": 1e-2, "bfloat16": 1e-2, "float32": 1e-4, "float64": 1e-10}


def _dump_json(doc, out):
    """Strict JSON (no NaN/Infinity literals): non-finite numbers become null."""
    def clean(x):
        if isinstance(x, float) and not math.isfinite(x):
            return None
        if isinstance(x, dict):
            return {k: clean(v) for k, v in x.items()}
        if isinstance(x, (list, tuple)):
            return [clean(v) for v in x]
        return x

    json.dump(clean(doc), out, indent=2, allow_nan=False)
    out.write("\n")


def _number(parse, ok, expected):
    """An argparse type: ``parse(text)``, refused unless ``ok`` of it (the error: ``expected
    ...``, then the text given)."""
    def convert(text):
        try:
            x = parse(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}") from None
        if not ok(x):
            raise argparse.ArgumentTypeError(f"expected {expected}, got {text}")
        return x

    return convert


_positive_int = _number(int, lambda n: n >= 1, "a positive integer")
_nonnegative_int = _number(int, lambda n: n >= 0, "a non-negative integer")
_positive_float = _number(float, lambda x: x > 0 and math.isfinite(x), "a positive number")
_nonnegative_float = _number(float, lambda x: x >= 0 and math.isfinite(x), "a number >= 0")


def _case_spec(text):
    try:
        return bench.parse_case(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _threads_arg(p):
    p.add_argument("--threads", type=_positive_int, metavar="N",
                   help="Numba (and torch) threads; default: Numba's default "
                        "(NUMBA_NUM_THREADS or the core count)")


def build_parser():
    from . import __version__

    parser = argparse.ArgumentParser(
        prog="python -m sdpa_numba",
        description="Scaled dot-product attention with Numba: check it, benchmark it, "
                    "describe the machine. Without a command, runs 'check' with its defaults.",
        epilog="exit codes: 0 ok, 1 check failed, 2 usage error, 3 unexpected error")
    parser.add_argument("--version", action="version", version=f"sdpa_numba {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="{check,bench,info,warmup}")

    p = sub.add_parser("check", help="compute one problem, compare with the float64 reference, "
                                     "time it (the default command)",
                       description="Compute attention for one problem, compare it (output and "
                                   "log-sum-exp) with the float64 NumPy reference, print the "
                                   "relative Frobenius error, time and GFLOP/s. Exit code 1 if "
                                   "the error is above the tolerance.")
    p.add_argument("-b", "--batch", type=_positive_int, default=1, help="B (default 1)")
    p.add_argument("--heads", type=_positive_int, default=8, help="H (default 8)")
    p.add_argument("-L", "--seq", type=_positive_int, default=1024,
                   help="query length L (default 1024)")
    p.add_argument("-S", "--kv-seq", type=_positive_int, default=None,
                   help="key/value length S (default: L)")
    p.add_argument("-E", "--dim", type=_positive_int, default=64, help="head dim E (default 64)")
    p.add_argument("--dtype", choices=bench.DTYPES, default="float32")
    p.add_argument("--causal", action="store_true", help="is_causal=True")
    p.add_argument("--repeats", type=_positive_int, default=10,
                   help="timed runs after the first call; the minimum is shown (default 10)")
    p.add_argument("--tol", type=_positive_float, default=None,
                   help="relative error allowed (default: float16 1e-3, bfloat16 4e-3, "
                        "float32 1e-5, float64 1e-12)")
    p.add_argument("--seed", type=_nonnegative_int, default=0)
    p.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    _threads_arg(p)
    p.set_defaults(subparser=p)

    p = sub.add_parser(
        "bench", help="time sdpa_numba against torch and naive NumPy over sizes and dtypes",
        description="Time sdpa_numba, torch.nn.functional.scaled_dot_product_attention (if "
                    "installed) and naive NumPy on the same inputs with the same thread count. "
                    "Each implementation is warmed up, then the minimum of interleaved rounds "
                    "is kept. GFLOP/s counts 4*B*H*L*S*E (half when causal). 'vs torch' is "
                    "torch's time / sdpa_numba's (above 1: sdpa_numba is faster). The cases are "
                    "a grid (--batch --heads --seq --dim --dtype --causal) unless --preset or "
                    "--case is given.",
)
    presets = {*bench.PRESETS, *bench_decode.PRESETS, *bench_varlen.PRESETS}
    p.add_argument("--preset", choices=sorted(presets),
                   action="append", default=[],
                   help="a named case list; headline: B1 H8 L2048 D64 float32 non-causal and "
                        "causal, B1 H4 L4096 D128 float32; decode: attention_with_kvcache "
                        "B1 H32 S8192 D128 and B1 Hq32 H8 S16384 D128 float32 as GB/s of K+V "
                        "against a NumPy streaming read and torch, and the tiny call B1 H1 "
                        "S512 D64 as the median after 50 ms idle; decode-more: a paged cache "
                        "(page 16) against decode's contiguous one, a ragged batch B16 "
                        "(lengths 128..8192, torch: padded with a mask), split-KV B1 H1 S1M "
                        "D128 on 2 threads against 1; decode-quant: decode's two cases with "
                        "int8, q8_0, e4m3fn and e5m2 caches against our float32 and float16 "
                        "caches (speed, output error) and the read; variants: soft cap, a user's "
                        "score_mod and a causal sliding window of 256 at B1 H8 L2048 D64 "
                        "float32 against torch's flex_attention and SDPA (a table of its own); "
                        "varlen: varlen_attention and its backward on 8 causal sequences of "
                        "100..2000 tokens, H8 D64 float32, against torch's SDPA padded with a "
                        "mask and in a loop over the sequences (a table of its own). The host "
                        "cost of small calls is scripts/small_calls.py's")
    p.add_argument("--case", type=_case_spec, action="append", default=[], metavar="SPEC",
                   help="one case BxHxLxD[:dtype][:causal], e.g. 1x8x2048x64:float32:causal "
                        "(repeatable)")
    p.add_argument("-b", "--batch", type=_positive_int, default=1, help="grid: B (default 1)")
    p.add_argument("--heads", type=_positive_int, default=8, help="grid: H (default 8)")
    p.add_argument("-L", "--seq", type=_positive_int, nargs="+", default=[512, 1024, 2048, 4096],
                   metavar="L", help="grid: sequence lengths, S = L (default 512 1024 2048 4096)")
    p.add_argument("-E", "--dim", type=_positive_int, nargs="+", default=[64], metavar="E",
                   help="grid: head dims (default 64)")
    p.add_argument("--dtype", choices=bench.DTYPES, nargs="+", default=["float32"],
                   help="grid: dtypes (default float32)")
    p.add_argument("--causal", choices=("no", "yes", "both"), default="both",
                   help="grid: non-causal, causal or both (default both)")
    p.add_argument("--impl", choices=bench.IMPLS, nargs="+", default=list(bench.IMPLS),
                   help="implementations to time (default all; torch is skipped when not "
                        "installed)")
    p.add_argument("--repeats", type=_positive_int, default=5,
                   help="interleaved timed rounds per case (default 5)")
    p.add_argument("--runs", type=_positive_int, default=1, metavar="N",
                   help="repeat the whole measurement N times and end with the median and "
                        "range of each figure over the runs (on a shared machine the ratio to "
                        "torch moves by 10-20%% between consecutive runs; default 1)")
    p.add_argument("--pause", type=_nonnegative_float, default=bench.PAUSE, metavar="SECONDS",
                   help=f"rest before each timed call, so that the previous library's spinning "
                        f"worker threads go to sleep (default {bench.PAUSE})")
    p.add_argument("--sgemm", action="store_true",
                   help="also measure float32 N x N matmul GFLOP/s (NumPy @, torch.mm): the "
                        "practical roof")
    p.add_argument("--sgemm-size", type=_positive_int, default=4096, metavar="N",
                   help="N for --sgemm (default 4096)")
    p.add_argument("--plot", metavar="FILE.png", help="draw GFLOP/s against L (matplotlib)")
    out_fmt = p.add_mutually_exclusive_group()
    out_fmt.add_argument("--json", action="store_true", help="print JSON instead of the table")
    out_fmt.add_argument("--markdown", action="store_true",
                         help="print the table in Markdown (as in docs/performance.md)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    _threads_arg(p)
    p.set_defaults(subparser=p)

    p = sub.add_parser("info", help="versions, threads, CPU features, CUDA availability, "
                                    "cached kernels",
                       description="Versions, threading layer and thread count, the CPU "
                                   "features Numba compiles for, whether CUDA is usable, and "
                                   "which CPU kernel specializations Numba's cache holds.")
    p.add_argument("--json", action="store_true", help="print JSON instead of text")

    from .precompile import DTYPES, MASKS

    p = sub.add_parser(
        "warmup", help="compile kernels into Numba's on-disk cache ahead of time",
        description="Compile the chosen CPU kernel specializations (one per dtype, mask kind "
                    "and dropout on/off for the forward; per dtype and mask kind for the "
                    "backward) into Numba's on-disk cache, so that later processes load them "
                    "in about a second instead of compiling (~10 s each). Run it while "
                    "building a container image or filling a CI cache; NUMBA_CACHE_DIR says "
                    "where the cache goes.")
    p.add_argument("--dtype", choices=DTYPES, nargs="+", default=["float32"],
                   help="storage dtypes (default float32)")
    p.add_argument("--mask", choices=MASKS, nargs="+", default=list(MASKS),
                   help="mask kinds: none, bool, additive (default all three)")
    p.add_argument("--dropout", choices=("no", "yes", "both"), default="no",
                   help="forward kernels without dropout, with it, or both (default no)")
    p.add_argument("--no-backward", action="store_true", help="forward kernels only")
    p.add_argument("--json", action="store_true", help="print JSON instead of text")
    return parser


# ----------------------------------------------------------------------------------- check


def _reference_per_head(q, k, v, is_causal):
    """The float64 reference, one head at a time (memory: one L x S matrix)."""
    from .reference import attention

    out = np.empty(q.shape[:-1] + v.shape[-1:], np.float64)
    lse = np.empty(q.shape[:-1], np.float64)
    for idx in np.ndindex(q.shape[:-2]):
        out[idx], lse[idx] = attention(q[idx], k[idx], v[idx], is_causal=is_causal)
    return out, lse


def _lse_error(lse, ref):
    """Relative error of the finite entries; inf if the -inf entries differ."""
    lse = np.asarray(lse, np.float64)
    fin = np.isfinite(ref)
    if not np.array_equal(fin, np.isfinite(lse)) or np.any(lse[~fin] != ref[~fin]):
        return math.inf
    return bench.rel_error(lse[fin], ref[fin]) if fin.any() else 0.0


def _set_threads(args, torch_too):
    """Apply --threads; a count above Numba's maximum is a usage error."""
    from numba import config

    if args.threads is not None and args.threads > config.NUMBA_NUM_THREADS:
        args.subparser.error(f"--threads {args.threads} is above Numba's maximum "
                             f"{config.NUMBA_NUM_THREADS} (set NUMBA_NUM_THREADS to raise it)")
    return bench.set_threads(args.threads, torch_too)


def cmd_check(args, out=None):
    out = out or sys.stdout
    from . import scaled_dot_product_attention as sdpa

    threads = _set_threads(args, torch_too=False)
    S = args.kv_seq or args.seq
    rng = np.random.default_rng(args.seed)
    shape_q = (args.batch, args.heads, args.seq, args.dim)
    shape_kv = (args.batch, args.heads, S, args.dim)
    q, k, v = (rng.standard_normal(s, dtype=np.float32).astype(bench.numpy_dtype(args.dtype))
               for s in (shape_q, shape_kv, shape_kv))
    flops = count_flops(args.batch, args.heads, args.seq, S, args.dim, args.causal)
    desc = (f"B={args.batch} H={args.heads} L={args.seq} S={S} E={args.dim} {args.dtype} "
            f"{'causal' if args.causal else 'non-causal'}, {threads} threads")

    t0 = time.perf_counter()
    result, lse = sdpa(q, k, v, is_causal=args.causal, return_lse=True)
    first = time.perf_counter() - t0
    best = math.inf
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        sdpa(q, k, v, is_causal=args.causal)
        best = min(best, time.perf_counter() - t0)

    ref_out, ref_lse = _reference_per_head(q, k, v, args.causal)
    err_out = bench.rel_error(result, ref_out)
    err_lse = _lse_error(lse, ref_lse)
    tol = args.tol if args.tol is not None else TOLERANCE[args.dtype]
    ok = bool(err_out <= tol and err_lse <= tol)  # NaN compares False: a failure
    gflops = flops / best / 1e9

    if args.json:
        _dump_json({"problem": {"batch": args.batch, "heads": args.heads, "seq": args.seq,
                                "kv_seq": S, "dim": args.dim, "dtype": args.dtype,
                                "causal": args.causal},
                    "threads": threads, "flops": flops, "first_call_s": first, "time_s": best,
                    "gflops": gflops, "rel_err_out": err_out, "rel_err_lse": err_lse,
                    "tolerance": tol, "ok": ok}, out)
    else:
        print(f"sdpa_numba check: {desc}", file=out)
        print(f"first call (compile, or load from Numba's cache): {first:.3f} s", file=out)
        print(f"time: {best * 1e3:.2f} ms (min of {args.repeats})   {gflops:.1f} GFLOP/s",
              file=out)
        print(f"relative Frobenius error vs float64 reference: out {err_out:.2e}, "
              f"lse {err_lse:.2e} (tolerance {tol:.0e})", file=out)
        print("OK" if ok else "FAILED: error above tolerance", file=out)
    return EXIT_OK if ok else EXIT_FAILED


# ----------------------------------------------------------------------------------- bench


def _bench_cases(args):
    cases = [c for name in args.preset if name in bench.PRESETS
             for c in bench.PRESETS[name]] + list(args.case)
    if cases or _decode_cases(args):
        return cases
    causals = {"no": [False], "yes": [True], "both": [False, True]}[args.causal]
    return bench.grid(args.batch, args.heads, args.seq, args.dim, args.dtype, causals)


def _progress_bar(total, disable):
    """A tqdm bar on stderr (None if disabled or tqdm is missing)."""
    if disable:
        return None
    try:
        from tqdm import tqdm
    except ImportError:
        print("(pip install tqdm for a progress bar)", file=sys.stderr)
        return None
    return tqdm(total=total, file=sys.stderr, unit="step", dynamic_ncols=True, leave=False)


def _warn_load():
    """The 1-minute load average (None where unknown), with a warning on stderr above 1."""
    load = bench.load_average()
    if load is not None and load > 1.0:
        print(f"warning: load average {load:.1f} before the run: other processes are using the "
              f"CPUs, timings will be noisy", file=sys.stderr)
    return load


def _decode_cases(args):
    return [c for name in args.preset if name in bench_decode.PRESETS
            for c in bench_decode.PRESETS[name]]


def cmd_bench_decode(args, cases, out):
    """The decode presets: GB/s of K+V against a NumPy read and torch, in the same run."""
    threads = _set_threads(args, torch_too=True)
    bw, results = bench_decode.run(cases, args.repeats, args.pause)
    if args.json:
        _dump_json({"threads": threads, "read_bytes_per_s": bw, "decode": results}, out)
        return EXIT_OK
    print(report.format_decode(results, bw, threads, bench_decode.read_label(threads),
                               args.markdown), file=out)
    return EXIT_OK


#: The presets that run alone, in the order they are looked for in ``--preset``, each with a
#: table of its own.
ALONE = ("varlen", "variants")


def cmd_bench_alone(args, preset, out):
    """A preset of :data:`ALONE`: ``variants`` (:func:`sdpa_numba.bench.variants.run_variants`)
    or ``varlen`` (:func:`sdpa_numba.bench.varlen.run`, its table headed by the threads)."""
    if preset == "variants":
        run, table, headed = bench.run_variants, bench.format_variants, False
    else:
        run, table, headed = bench_varlen.run, bench_varlen.format_result, True
    threads = _set_threads(args, torch_too=True)
    load = _warn_load()
    res = run(args.repeats, args.pause)
    res["load_average_1min_before"] = load
    if args.json:
        _dump_json({"info": bench.collect_info(), "threads": threads, preset: res}, out)
        return EXIT_OK
    if headed:
        print(f"sdpa_numba bench: {threads} threads", file=out)
    print(table(res), file=out)
    return EXIT_OK


def cmd_bench(args, out=None):
    out = out or sys.stdout
    parser = args.subparser
    for preset in ALONE:
        if preset in args.preset:
            if len(args.preset) > 1 or args.case or args.plot:
                parser.error(f"--preset {preset} runs alone (no other preset, --case or --plot)")
            return cmd_bench_alone(args, preset, out)
    decode_cases = _decode_cases(args)
    if decode_cases:
        code = cmd_bench_decode(args, decode_cases, out)
        if not _bench_cases(args):
            return code
    if args.plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            parser.error("--plot needs matplotlib: pip install 'sdpa_numba[bench]'")
        if not args.plot.lower().endswith(".png"):
            parser.error(f"--plot writes a PNG: give a FILE.png, got {args.plot!r}")
    cases = _bench_cases(args)
    impls = [i for i in bench.IMPLS if i in args.impl]
    threads = _set_threads(args, torch_too="torch" in impls)
    load = _warn_load()
    bar = _progress_bar(args.runs * bench.steps(cases, impls, args.repeats), args.no_progress)

    def progress(n, label):
        if bar is not None:
            bar.set_description(label)
            bar.update(n)

    runs = []
    try:
        for _ in range(args.runs):
            sgemm = bench.sgemm_rates(args.sgemm_size) if args.sgemm else None
            runs.append((sgemm, bench.run_cases(cases, impls, args.repeats, progress,
                                                args.pause)))
    finally:
        if bar is not None:
            bar.close()
    sgemm, results = runs[-1]
    shown = [i for i in impls if any(i in r["time_s"] for r in results)]
    disagree = [r for r in results
                if r.get("rel_err_vs_torch", 0.0) > AGREEMENT[r["dtype"]]
                or math.isnan(r.get("rel_err_vs_torch", 0.0))]
    info = bench.collect_info()
    if args.json:
        _dump_json({"info": info, "threads": threads, "load_average_1min_before": load,
                    "repeats": args.repeats, "sgemm_size": args.sgemm_size if sgemm else None,
                    "sgemm_gflops": sgemm, "results": results,
                    "runs": [{"sgemm_gflops": sg, "results": rs} for sg, rs in runs]}, out)
    else:
        print(report.format_dense(runs, shown, threads, info, load, args.repeats,
                                  torch_missing="torch" in args.impl and "torch" not in shown,
                                  sgemm_size=args.sgemm_size, markdown=args.markdown),
              file=out)
    if args.plot:
        report.plot_results(results, args.plot, sgemm,
                            title=f"sdpa_numba bench, {threads} threads, "
                                  f"{info['cpu']['name']}, load average before the run "
                                  f"{report.fmt(load, '.1f')}",
                            sgemm_size=args.sgemm_size)
        print(f"plot written to {args.plot}", file=sys.stderr)
    for r in disagree:
        label = report.label(r)
        print(f"FAILED: sdpa_numba and torch disagree on {label}: relative error "
              f"{r['rel_err_vs_torch']:.2e} > {AGREEMENT[r['dtype']]:.0e}", file=sys.stderr)
    return EXIT_FAILED if disagree else EXIT_OK


# ------------------------------------------------------------------------------------ info


def cmd_info(args, out=None):
    from .precompile import cached_kernels

    out = out or sys.stdout
    info = bench.collect_info()
    info["cached"] = cached_kernels()
    if args.json:
        _dump_json(info, out)
        return EXIT_OK
    v = info["versions"]
    cpu = info["cpu"]
    lines = [f"{name:<11} {v[name] or 'not installed'}" for name in v]
    lines += [
        f"threads     {info['threads']} (Numba; set NUMBA_NUM_THREADS or --threads)",
        f"threading   {info['threading_layer']}",
        f"load        {report.fmt(info['load_average_1min'], '.2f')} (1-minute load average)",
        f"platform    {info['platform']}",
        f"cpu         {cpu['name']}"
        + (" (from NUMBA_CPU_NAME/NUMBA_CPU_FEATURES)" if cpu["from_numba_env_override"] else ""),
        f"  avx2 {'yes' if cpu['avx2'] else 'no'}, fma {'yes' if cpu['fma'] else 'no'}, "
        f"avx512f {'yes' if cpu['avx512f'] else 'no'}"
        + (f" ({', '.join(cpu['avx512_extensions'])})" if cpu["avx512_extensions"] else ""),
        f"  features  {' '.join(cpu['features'])}",
        f"cuda        {'usable' if info['cuda']['usable'] else 'not usable'}: "
        f"{info['cuda']['detail']}",
        f"cached      {len(info['cached'])} CPU kernel specializations in Numba's cache"
        + " (python -m sdpa_numba warmup compiles more)",
        *(f"  {s}" for s in info["cached"]),
    ]
    print("\n".join(lines), file=out)
    return EXIT_OK


# ---------------------------------------------------------------------------------- warmup


def cmd_warmup(args, out=None):
    from .precompile import warmup

    out = out or sys.stdout
    dropout = {"no": (False,), "yes": (True,), "both": (False, True)}[args.dropout]

    def progress(record):
        if not args.json:
            how = "loaded from the cache" if record["was_cached"] else "compiled"
            print(f"{record['name']:<40} {how} in {record['seconds']:.1f} s", file=out,
                  flush=True)

    done = [{k: x for k, x in r.items() if k != "name"}
            for r in warmup(args.dtype, args.mask, dropout, backward=not args.no_backward,
                            progress=progress)]
    if args.json:
        _dump_json({"specializations": done}, out)
    missing = [d for d in done if d["cached"] is False]
    if missing:
        print(f"sdpa_numba warmup: {len(missing)} specializations could not be cached (is "
              f"the cache directory writable? set NUMBA_CACHE_DIR)", file=sys.stderr)
        return EXIT_FAILED
    return EXIT_OK


def main(argv: "list[str] | None" = None) -> int:
    """Run the command line with ``argv`` (default ``sys.argv[1:]``); return the exit code."""
    parser = build_parser()
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        args = parser.parse_args(argv or ["check"])
        if args.command is None:  # only top-level options (none run anything)
            args = parser.parse_args(["check"])
        if args.command == "check":
            return cmd_check(args)
        if args.command == "bench":
            return cmd_bench(args)
        if args.command == "warmup":
            return cmd_warmup(args)
        return cmd_info(args)
    except SystemExit as exc:  # argparse: --help/--version (0) or a usage error (2)
        return exc.code if isinstance(exc.code, int) else EXIT_USAGE
    except BrokenPipeError:  # output piped into e.g. `head`
        return EXIT_OK
    except MemoryError as exc:  # sizes too large for this machine: no traceback needed
        print(f"sdpa_numba: not enough memory for this problem ({exc})", file=sys.stderr)
        return EXIT_ERROR
    except Exception:  # a crash must not read as "check failed" (1) to a script
        traceback.print_exc()
        print("sdpa_numba: unexpected error (exit code 3)", file=sys.stderr)
        return EXIT_ERROR
