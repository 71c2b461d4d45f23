"""The benchmarks' tables as text (aligned columns) or Markdown (as in docs/performance.md),
and the dense benchmark's plot of GFLOP/s against L."""

import math
import statistics

from .dense import IMPLS, Case


def fmt(x, spec):
    return "-" if x is None or (isinstance(x, float) and not math.isfinite(x)) else format(x, spec)


def label(r):
    return Case(r["batch"], r["heads"], r["seq"], r["dim"], r["dtype"], r["causal"]).label


def render(head, rows, markdown):
    """A table: Markdown (numbers right-aligned), or text with aligned columns."""
    if markdown:
        lines = ["| " + " | ".join(line) + " |" for line in [head] + rows]
        lines.insert(1, "| --- |" + " ---: |" * (len(head) - 1))
        return "\n".join(lines)
    widths = [max(len(str(x)) for x in col) for col in zip(head, *rows)]
    lines = ["  ".join(str(x).ljust(w) if i == 0 else str(x).rjust(w)
                       for i, (x, w) in enumerate(zip(line, widths))) for line in [head] + rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def format_table(results, impls, markdown=False):
    """One row per case: the speed ratio to torch, then ms and GFLOP/s per implementation.

    ``markdown=True`` gives a Markdown table (for docs/performance.md), else aligned text.
    """
    has_torch = any("speed_vs_torch" in r for r in results)
    has_numpy = any("speed_vs_numpy" in r for r in results)
    head = ["case"] + (["vs torch"] if has_torch else [])
    for impl in impls:
        head += [f"{impl} ms", "GFLOP/s"]
    head += (["err vs torch"] if has_torch else []) + (["vs numpy"] if has_numpy else [])
    rows = []
    for r in results:
        row = [label(r)]
        if has_torch:
            row.append(fmt(r.get("speed_vs_torch"), ".2f") + ("x" if "speed_vs_torch" in r else ""))
        for impl in impls:
            t = r["time_s"].get(impl)
            row += [fmt(None if t is None else t * 1e3, ".2f"), fmt(r["gflops"].get(impl), ".1f")]
        if has_torch:
            row.append(fmt(r.get("rel_err_vs_torch"), ".1e"))
        if has_numpy:
            row.append(fmt(r.get("speed_vs_numpy"), ".1f") + ("x" if "speed_vs_numpy" in r else ""))
        rows.append(row)
    return render(head, rows, markdown)


def summarize_runs(runs, markdown=False):
    """Median and range over ``runs`` (a list of ``(sgemm, results)``) of each case's ratio to
    torch, GFLOP/s and, with the matmul rates, the fraction of torch's matmul rate."""

    def stat(xs, spec, suffix=""):
        xs = [x for x in xs if x is not None and math.isfinite(x)]
        if not xs:
            return "-"
        return (f"{fmt(statistics.median(xs), spec)}{suffix} "
                f"({fmt(min(xs), spec)}-{fmt(max(xs), spec)})")

    head = ["case", "vs torch", "sdpa_numba GFLOP/s", "torch GFLOP/s", "% of torch matmul"]
    rows = []
    for c, first in enumerate(runs[0][1]):
        per = [results[c] for _, results in runs]
        ours = [r["gflops"].get("sdpa_numba") for r in per]
        roofs = [(sg or {}).get("torch") for sg, _ in runs]
        rows.append([label(first),
                     stat([r.get("speed_vs_torch") for r in per], ".2f", "x"),
                     stat(ours, ".1f"),
                     stat([r["gflops"].get("torch") for r in per], ".1f"),
                     stat([100 * o / m if o and m else None for o, m in zip(ours, roofs)],
                          ".0f", "%")])
    return render(head, rows, markdown)


def plot_results(results, path, sgemm=None, title=None, sgemm_size=4096):
    """GFLOP/s against L, one panel per (B, H, E, dtype, causal), one line per implementation."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = {}
    for r in results:
        key = (r["batch"], r["heads"], r["dim"], r["dtype"], r["causal"])
        groups.setdefault(key, []).append(r)
    n = len(groups)
    ncols = min(n, 3)
    nrows = math.ceil(n / ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(5.2 * ncols, 4.0 * nrows), squeeze=False)
    styles = {"sdpa_numba": dict(color="C0", marker="o"), "torch": dict(color="C1", marker="s"),
              "numpy": dict(color="C2", marker="^")}
    for ax, ((b, h, e, dt, causal), rs) in zip(axes.flat, groups.items()):
        rs = sorted(rs, key=lambda r: r["seq"])
        xs = [r["seq"] for r in rs]
        for impl in IMPLS:
            ys = [r["gflops"].get(impl, math.nan) for r in rs]
            if not all(math.isnan(y) for y in ys):
                ax.plot(xs, ys, label=impl, linewidth=2, **styles[impl])
        for name, rate in (sgemm or {}).items():
            ax.axhline(rate, color="grey", linestyle="--" if name == "torch" else ":",
                       linewidth=1.2, label=f"float32 matmul {sgemm_size}² ({name})")
        ax.set_xscale("log", base=2)
        ax.set_xticks(xs, [str(x) for x in xs])
        ax.set_ylim(bottom=0)
        ax.set_xlabel("sequence length L (= S)")
        ax.set_ylabel("GFLOP/s")
        ax.set_title(f"B{b} H{h} D{e} {dt}{' causal' if causal else ''}")
        ax.grid(True, alpha=0.3)
    for ax in list(axes.flat)[n:]:
        ax.set_visible(False)
    legend = {}  # one legend for every panel, under them, so that no curve is hidden
    for ax in axes.flat:
        for handle, label in zip(*ax.get_legend_handles_labels()):
            legend.setdefault(label, handle)
    fig.legend(legend.values(), legend.keys(), loc="lower center", ncol=min(len(legend), 5),
               fontsize=9, frameon=False)
    if title:
        fig.suptitle(title)
    fig.tight_layout(rect=(0, 0.09 / nrows, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def format_decode(results, bw, threads, read_label, markdown=False):
    """The decode presets' result: a title line (the streaming read's ``bw`` bytes/s before the
    cases, ``read_label`` saying how it was read) and one row per case."""
    title = (f"sdpa_numba bench (decode): {threads} threads; "
             f"{read_label}: {bw / 1e9:.1f} GB/s before the cases; "
             f"each case's % of read is against the read timed in its own rounds (read GB/s)")
    head = ["case", "timing", "vs torch", "sdpa_numba ms", "GB/s", "% of read", "read GB/s",
            "torch ms", "torch GB/s", "err vs torch", "vs 1 thread"]
    rows = []
    for r in results:
        t, g = r["time_s"], r["gb_per_s"]
        rows.append([r["case"], r["timing"],
                     fmt(r.get("speed_vs_torch"), ".2f") + ("x" if "speed_vs_torch" in r else ""),
                     fmt(t["sdpa_numba"] * 1e3, ".3f"), fmt(g["sdpa_numba"], ".1f"),
                     fmt(100 * r["of_read_bandwidth"], ".0f") + "%",
                     fmt(r["read_bytes_per_s"] / 1e9, ".1f"),
                     fmt(t.get("torch", math.nan) * 1e3, ".3f"), fmt(g.get("torch"), ".1f"),
                     fmt(r.get("rel_err_vs_torch"), ".1e"),
                     fmt(r.get("speedup_vs_one_thread"), ".2f")])
    table = title + "\n" + render(head, rows, markdown)
    quant = [r for r in results if "speed_vs_float32_cache" in r]
    if not quant:
        return table
    # Quantized caches (decode-quant): against our float caches of the same tokens.
    head = ["case", "vs float32 cache", "vs float16 cache", "err vs float32 cache"]
    rows = [[r["case"], fmt(r["speed_vs_float32_cache"], ".2f") + "x",
             fmt(r["speed_vs_float16_cache"], ".2f") + "x",
             fmt(r["rel_err_vs_float32_cache"], ".1e")] for r in quant]
    return (table + "\n\nquantized caches against sdpa_numba's float caches of the same tokens "
            "(torch has no quantized cache: its column reads a float32 one)\n"
            + render(head, rows, markdown))


def format_dense(runs, shown, threads, info, load, repeats, torch_missing=False,
                 sgemm_size=4096, markdown=False):
    """The dense benchmark's result: a title line (threads, CPU, load), the last run's table
    of the implementations ``shown``, the first sdpa_numba call per dtype, the matmul rates and,
    over several ``runs`` (a list of ``(sgemm, results)``), the median and range of each
    figure. ``torch_missing``: torch was asked for and is not installed."""
    sgemm, results = runs[-1]
    lines = [f"sdpa_numba bench: {threads} threads ({info['threading_layer']}), CPU "
             f"{info['cpu']['name']}, avx512f {'yes' if info['cpu']['avx512f'] else 'no'}, "
             f"load average before {fmt(load, '.1f')}; time = min of {repeats} "
             f"interleaved runs after warm-up"]
    if torch_missing:
        lines.append("torch is not installed: no torch column (pip install 'sdpa_numba[bench]')")
    lines.append(format_table(results, shown, markdown=markdown))
    for r in runs[0][1]:  # the first run's: later runs find the kernels warm
        if "first_call_s" in r:
            lines.append(f"first sdpa_numba call, {r['dtype']} (compile or load from Numba's "
                         f"cache; not in the times): {r['first_call_s']:.2f} s")
    if sgemm:
        n = sgemm_size
        lines.append(f"float32 {n}x{n} matmul: " + ", ".join(
            f"{k} {v:.1f} GFLOP/s" for k, v in sgemm.items()))
    if len(runs) > 1:
        lines.append(f"\nover {len(runs)} runs (the table above is the last): median (min-max)")
        lines.append(summarize_runs(runs, markdown=markdown))
    return "\n".join(lines)
