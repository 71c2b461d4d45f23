"""Regenerate every measured number in the docs from the current code.

Each number on a page stands in a block between two markers::

    <!-- numbers: NAME -->
    ... written by this script: the command, when and where it ran, its output ...
    <!-- /numbers -->

and this script reruns the block's command and rewrites the block (``tests/test_doc_numbers.py``
checks that no measured figure stands outside such a block). Run it on a quiet machine, from
a checkout with the ``bench`` extra installed::

    python docs/make_numbers.py              # every block (10-15 minutes on two cores)
    python docs/make_numbers.py headline     # one block
    python docs/make_numbers.py --list       # the blocks and their commands

The figure ``docs/img/bench_gflops.png`` is redrawn by the ``sweep`` block.
"""

import argparse
import datetime
import json
import os
import pathlib
import platform
import re
import subprocess
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
BLOCK = re.compile(r"(<!-- numbers: (?P<name>[a-z0-9_-]+) -->\n)(?P<body>.*?)(<!-- /numbers -->)",
                   re.S)
PY = "python"  # as the commands are shown on the pages


def _run(args, env=None):
    proc = subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True,
                          env={**os.environ, **(env or {})}, timeout=3600)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(args)} failed:\n{proc.stdout}\n{proc.stderr}")
    return proc.stdout


def _bench(args):
    """A ``bench`` command shown on the page, and its Markdown output."""
    cmd = ["-m", "sdpa_numba", "bench", *args, "--no-progress", "--markdown"]
    return f"{PY} {' '.join(cmd)}", _run(cmd)


def _code(cmd, text, lang="text"):
    return f"```bash\n{cmd}\n```\n\n```{lang}\n{text.rstrip()}\n```\n"


def headline():
    cmd, out = _bench(["--preset", "headline", "--sgemm", "--runs", "5", "--repeats", "7"])
    return f"```bash\n{cmd}\n```\n\n{out}"


def dtypes():
    cmd, out = _bench(["-L", "1024", "--dtype", "float16", "float32", "float64", "--causal",
                       "no", "--runs", "3", "--repeats", "5"])
    return f"```bash\n{cmd}\n```\n\n{out}"


def bf16():
    """bfloat16 against torch's bfloat16 SDPA (the scores by vdpbf16ps where the CPU has
    AVX-512 BF16), D64 and D128, causal too."""
    cmd, out = _bench(["--case", "1x8x2048x64:bfloat16", "--case", "1x8x2048x64:bfloat16:causal",
                       "--case", "1x4x4096x128:bfloat16", "--runs", "3", "--repeats", "5"])
    return f"```bash\n{cmd}\n```\n\n{out}"


def sweep():
    cmd, out = _bench(["-L", "512", "1024", "2048", "4096", "--causal", "both",
                       "--plot", "docs/img/bench_gflops.png"])
    return f"```bash\n{cmd}\n```\n\n{out}\n![GFLOP/s against L](img/bench_gflops.png)\n"


def backward():
    args = ["tests/benchmarks/test_bench_backward.py", "10"]
    out = _run(args, {"PYTHONPATH": str(ROOT)})
    return _code(f"PYTHONPATH=. {PY} {' '.join(args)}", out)


def compile_time():
    """The first call in a fresh process: with an empty Numba cache, then from the cache."""
    rows = []
    with tempfile.TemporaryDirectory() as cache:
        env = {"NUMBA_CACHE_DIR": cache}
        for label in ("cold (empty `NUMBA_CACHE_DIR`: compiles float32, no mask)",
                      "from Numba's on-disk cache"):
            doc = json.loads(_run(["-m", "sdpa_numba", "check", "-L", "256", "--heads", "1",
                                   "--json"], env))
            rows.append(f"| first call in a fresh process, {label} | "
                        f"{doc['first_call_s']:.1f} s |")
    cmd = f"NUMBA_CACHE_DIR=$(mktemp -d) {PY} -m sdpa_numba check -L 256 --heads 1  # twice"
    return (f"```bash\n{cmd}\n```\n\n| what | time |\n| --- | ---: |\n" + "\n".join(rows)
            + "\n")


def transformers():
    """End to end: a ~100M-parameter Llama-style model on sdpa_numba against torch's SDPA."""
    args = ["scripts/bench_transformers.py", "--threads", "2", "--rounds", "2"]
    out = _run(args, {"NUMBA_NUM_THREADS": "2", "PYTHONPATH": str(ROOT)})
    return f"```bash\nNUMBA_NUM_THREADS=2 {PY} {' '.join(args)}\n```\n\n{out}"


def _ring(args):
    """scripts/ring_bench.py (ring attention under mpiexec against one process)."""
    args = ["scripts/ring_bench.py", *args]
    out = _run(args, {"PYTHONPATH": str(ROOT)})
    return _code(f"{PY} {' '.join(args)}", out)


def ring():
    return _ring(["--L", "32768", "--ranks", "2", "--rounds", "2"])


def ring4():
    return _ring(["--L", "16384", "--ranks", "4", "--threads", "2", "--rounds", "2"])


def decode():
    """The decode presets: attention_with_kvcache against a NumPy read and torch's SDPA."""
    cmd, out = _bench(["--preset", "decode", "--preset", "decode-more"])
    return f"```bash\n{cmd}\n```\n\n{out}"


def decode_quant():
    """The decode-quant preset: 8-bit caches against our float caches and torch's SDPA."""
    cmd, out = _bench(["--preset", "decode-quant"])
    return f"```bash\n{cmd}\n```\n\n{out}"


def rope():
    """A decode step with rotary embedding on append against one without
    (scripts/bench_rope.py)."""
    args = ["scripts/bench_rope.py", "--calls", "40"]
    return _code(f"NUMBA_NUM_THREADS=2 {PY} {' '.join(args)}",
                 _run(args, {"NUMBA_NUM_THREADS": "2"}))


def cascade():
    """Shared-prefix (cascade) attention against per-request paged decode and one batched
    paged call (scripts/bench_cascade.py, issue 31's case)."""
    args = ["scripts/bench_cascade.py", "--threads", "2"]
    out = _run(args, {"PYTHONPATH": str(ROOT)})
    return _code(f"PYTHONPATH=. {PY} {' '.join(args)}", out)


def mla():
    """Absorbed MLA decode with the value cache a view of the key cache, against a separate
    copy and NumPy's read (scripts/bench_mla.py)."""
    args = ["scripts/bench_mla.py", "--threads", "2"]
    out = _run(args, {"PYTHONPATH": str(ROOT)})
    return _code(f"PYTHONPATH=. {PY} {' '.join(args)}", out)


def quant_errors():
    """The 8-bit cache formats' error against the original float cache
    (scripts/quant_errors.py)."""
    args = ["scripts/quant_errors.py"]
    out = _run(args, {"PYTHONPATH": str(ROOT)})
    return f"```bash\nPYTHONPATH=. {PY} {' '.join(args)}\n```\n\n{out}"


def quant_greedy():
    """Greedy decoding of a small random-weight model with 8-bit caches against a float32
    cache (scripts/quant_greedy.py), at transformers' initial weight scale and a larger one."""
    parts = []
    for init in ("0.02", "0.1"):
        args = ["scripts/quant_greedy.py", "--init", init]
        out = _run(args, {"PYTHONPATH": str(ROOT)})
        parts.append(f"```bash\nPYTHONPATH=. {PY} {' '.join(args)}\n```\n\n{out}")
    return "\n".join(parts)


def varlen():
    """The varlen preset: a packed ragged batch, forward and backward, against torch's two
    ways (a padded batch with a mask; a loop of per-sequence calls)."""
    cmd, out = _bench(["--preset", "varlen"])
    return f"```bash\n{cmd}\n```\n\n{out}"


def variants():
    """The variants preset: soft cap, a user's score_mod, a causal window, against
    flex_attention and SDPA."""
    cmd, out = _bench(["--preset", "variants"])
    return f"```bash\n{cmd}\n```\n\n{out}"


def layers():
    """Numba's threading layers side by side (scripts/threading_layers.py): large calls and the
    small ones whose time is mostly the layer's launch cost."""
    args = ["scripts/threading_layers.py", "--rounds", "3", "--reps", "5", "--small-reps", "200"]
    return _code(f"{PY} {' '.join(args)}", _run(args))


def jax():
    """sdpa_numba.jax under jax.jit against jax.nn.dot_product_attention and the NumPy API on
    the same arrays (sdpa_numba.bench.jax_bridge)."""
    args = ["-m", "sdpa_numba.bench.jax_bridge", "--threads", "2", "--rounds", "7"]
    return _code(f"{PY} {' '.join(args)}", _run(args, env={"NUMBA_NUM_THREADS": "2"}))


def check():
    return _code("$ python -m sdpa_numba", _run(["-m", "sdpa_numba"]))


def small_calls():
    """The host cost of a small call (scripts/small_calls.py): each public function, its
    kernel alone, the host path alone, torch's SDPA beside the forward."""
    args = ["scripts/small_calls.py", "--repeats", "3"]
    return _code(f"PYTHONPATH=. {PY} {' '.join(args)}", _run(args, {"PYTHONPATH": str(ROOT)}))


GENERATORS = {"headline": headline, "dtypes": dtypes, "bf16": bf16, "sweep": sweep, "backward": backward,
              "compile": compile_time, "check": check, "transformers": transformers,
              "ring": ring, "ring4": ring4,
              "decode": decode, "cascade": cascade, "mla": mla, "quant_errors": quant_errors,
              "quant_greedy": quant_greedy, "rope": rope,
              "decode_quant": decode_quant, "varlen": varlen, "variants": variants, "layers": layers,
              "jax": jax, "small_calls": small_calls}

#: The blocks kept per kind of CPU: the AVX-512 one under the plain name, the AVX2 one under
#: ``NAME-avx2`` (the same command). A run writes the blocks of its machine's kind only, so
#: that a figure never stands under the other kind's heading.
PER_CPU_KIND = ("headline", "bf16", "backward", "compile", "small_calls")
GENERATORS.update({f"{name}-avx2": GENERATORS[name] for name in PER_CPU_KIND})


def _kind_skips(name, avx512):
    """Why block ``name`` is not written on this machine (None if it is)."""
    base, _, kind = name.partition("-")
    if base not in PER_CPU_KIND:
        return None
    if kind == "avx2" and avx512:
        return "an AVX2 block: this CPU has AVX-512"
    if not kind and not avx512:
        return f"an AVX-512 block: this CPU has no AVX-512 (its figures go to {base}-avx2)"
    return None


def _machine():
    return json.loads(_run(["-m", "sdpa_numba", "info", "--json"]))


def _stamp(info):
    git = lambda *a: subprocess.run(["git", *a], cwd=ROOT, capture_output=True,  # noqa: E731
                                    text=True).stdout.strip()
    commit = git("log", "-1", "--format=%h") or "unknown"
    if git("status", "--porcelain", "--untracked-files=no", "--", "sdpa_numba"):
        commit += " with uncommitted changes to sdpa_numba/"
    cpu = info["cpu"]["name"]
    when = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    return (f"*Measured {when} at commit `{commit}` on {cpu} ({os.cpu_count()} cores, "
            f"load average {load:.1f} at the start, "
            f"{info['threading_layer']} threading layer, Python {platform.python_version()}), "
            f"by `python docs/make_numbers.py`.*\n\n")


def blocks(text):
    """The names of the generated blocks in a page's text, in order."""
    return [m["name"] for m in BLOCK.finditer(text)]


def replace_block(text, name, body):
    """``text`` with the body of block ``name`` replaced; KeyError if it has no such block."""
    found = False

    def sub(m):
        nonlocal found
        if m["name"] != name:
            return m.group(0)
        found = True
        return m.group(1) + body.rstrip("\n") + "\n" + m.group(4)

    new = BLOCK.sub(sub, text)
    if not found:
        raise KeyError(name)
    return new


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("names", nargs="*", choices=[[]] + sorted(GENERATORS),
                        help="blocks to regenerate (default: all)")
    parser.add_argument("--list", action="store_true", help="list the blocks and their pages")
    args = parser.parse_args(argv)
    pages = {p: p.read_text() for p in sorted(DOCS.glob("*.md"))}
    where = {n: p for p, t in pages.items() for n in blocks(t)}
    if args.list:
        for name in GENERATORS:
            print(f"{name:10} {where.get(name, '(on no page)')}")
        return 0
    info = _machine()
    stamp = _stamp(info)
    for name in args.names or list(GENERATORS):
        if name not in where:
            print(f"{name}: no page has this block", file=sys.stderr)
            continue
        skip = _kind_skips(name, info["cpu"]["avx512f"])
        if skip:
            print(f"{name}: skipped, {skip}", file=sys.stderr)
            continue
        print(f"{name} ...", file=sys.stderr, flush=True)
        page = where[name]
        pages[page] = replace_block(pages[page], name, stamp + GENERATORS[name]())
        page.write_text(pages[page])
    return 0


if __name__ == "__main__":
    sys.exit(main())
