"""What a quantized KV-cache decode costs to compile on a cold Numba cache (issue 33 item 3,
issue 29's kernel): CPU seconds of each first call, in order, in one fresh process, and the
compiled functions that took them (Numba's ``numba:compile`` events, CPU seconds of the
compiling thread, exclusive of the functions compiled inside).

The steps run in one process, each after the ones before it, so that a step's figure is what
it adds: the first int8 decode (float32 queries, the serial kernel), then specializations that
differ in one thing (the query dtype, the scales' dtype, the recipe type, the parallel
kernel), then the other formats (which share their specialization). Each run is a new process
with ``NUMBA_CACHE_DIR`` a new empty folder; ``--vs ROOT`` runs a second source tree in turn
(A B A B ...). CPU seconds are the figures to compare on a shared machine (compiling runs on
one thread).

    nice -n 5 python scripts/quant_compile_profile.py [--runs 1] [--vs /path/to/checkout]
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

#: (label, cache format, query dtype, scale dtype, variants, parallel)
STEPS = [
    ("int8 f32 (first)", "int8", "float32", "float32", {}, False),
    ("int8 f16 query", "int8", "float16", "float32", {}, False),
    ("int8 bf16 query", "int8", "bfloat16", "float32", {}, False),
    ("int8 f32 alibi", "int8", "float32", "float32", {"alibi": True}, False),
    ("q8_0 f32 f16-scales", "q8_0", "float32", "float16", {}, False),
    ("e4m3 f32", "e4m3fn", "float32", None, {}, False),
    ("e5m2 f32", "e5m2", "float32", None, {}, False),
    ("int8 f32 parallel", "int8", "float32", "float32", {}, True),
]


def _child(top, n_steps):
    """In a cold process: run the first ``n_steps`` of :data:`STEPS`, print a JSON list of
    per-step results."""
    import numpy as np

    from cold_start import compile_times  # this script's folder (sys.path[0])

    _, excl, _ = compile_times()
    t_import = time.process_time()
    import sdpa_numba
    from sdpa_numba import attention_with_kvcache, quantize_kv

    try:
        import ml_dtypes
        bf16 = ml_dtypes.bfloat16
    except ImportError:  # pragma: no cover
        bf16 = None
    out = [{"step": "import", "cpu_s": time.process_time() - t_import, "functions": []}]
    rng = np.random.default_rng(0)
    for label, fmt, qdt, sdt, variants, parallel in STEPS[:n_steps]:
        excl.clear()
        b, h, g, d = (1, 8, 1, 128)
        s = 4096 if parallel else 64
        dt = bf16 if qdt == "bfloat16" else np.dtype(qdt)
        q = rng.standard_normal((b, 1, h * g, d)).astype(dt)
        k = rng.standard_normal((b, s, h, d)).astype(np.float32)
        v = rng.standard_normal((b, s, h, d)).astype(np.float32)
        kw = dict(variants)
        if kw.pop("alibi", False):
            kw["alibi_slopes"] = np.linspace(0.1, 1.0, h * g).astype(np.float32)
        t0 = time.process_time()
        kq, ks = quantize_kv(k, fmt, **({} if sdt is None else {"scale_dtype": sdt}))
        vq, vs = quantize_kv(v, fmt, **({} if sdt is None else {"scale_dtype": sdt}))
        t1 = time.process_time()
        attention_with_kvcache(q, kq, vq, np.array([s], np.int64), k_scale=ks, v_scale=vs,
                               **kw)
        t2 = time.process_time()
        funcs = sorted(excl.items(), key=lambda x: -x[1])[:top]
        out.append({"step": label, "quantize_cpu_s": t1 - t0, "cpu_s": t2 - t1,
                    "functions": funcs})
    print(json.dumps({"root": os.path.dirname(os.path.dirname(sdpa_numba.__file__)),
                      "steps": out}))


def run(root, top, n_steps):
    """One cold process of ``root``: its parsed result."""
    with tempfile.TemporaryDirectory(prefix="quant_compile_") as cache:
        env = dict(os.environ, NUMBA_CACHE_DIR=cache, PYTHONPATH=root)
        res = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", str(top),
                              str(n_steps)],
                             cwd=root, env=env, capture_output=True, text=True, check=False)
    if res.returncode != 0:
        raise SystemExit(f"{root}: exit {res.returncode}\n{res.stdout}\n{res.stderr}")
    return json.loads(res.stdout.strip().splitlines()[-1])


def main():
    if len(sys.argv) > 2 and sys.argv[1] == "--child":
        _child(int(sys.argv[2]), int(sys.argv[3]))
        return
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=int, default=1)
    p.add_argument("--vs", default=None, help="a second source tree, run in turn")
    p.add_argument("--top", type=int, default=6, help="functions listed per step")
    p.add_argument("--steps", type=int, default=len(STEPS),
                   help=f"the first STEPS of the {len(STEPS)} steps (default all)")
    a = p.parse_args()
    roots = [HERE] + ([os.path.abspath(a.vs)] if a.vs else [])
    for i in range(a.runs):
        for r in roots:
            doc = run(r, a.top, a.steps)
            print(f"run {i + 1}: {doc['root']} (load average "
                  f"{' '.join(f'{x:.1f}' for x in os.getloadavg())})")
            total = 0.0
            for st in doc["steps"]:
                total += st["cpu_s"] + st.get("quantize_cpu_s", 0.0)
                qz = st.get("quantize_cpu_s")
                print(f"  {st['step']:22} decode {st['cpu_s']:7.2f} s CPU"
                      + ("" if qz is None else f"  (quantize_kv {qz:5.2f} s)"))
                for name, t in st["functions"]:
                    if t >= 0.5:
                        print(f"      {t:7.2f}  {name}")
            print(f"  total {total:.2f} s CPU", flush=True)


if __name__ == "__main__":
    main()
