"""Make the figures of docs/math.md with sdpa_numba itself.

    python docs/make_figures.py            # writes docs/img/*.png (about a minute on 2 cores)

Every number in the figures comes out of the library (in float32, the common case):

* a score ``scale · q·k`` is the log-sum-exp of a row with a single key, so
  ``scaled_dot_product_attention(q, k, v, scale=..., return_lse=True)`` with ``S = 1`` returns
  it;
* the softmax probabilities ``P`` of a row are its attention output when ``V`` is the identity
  matrix (``P · I = P``);
* the online softmax is run block by block with :func:`sdpa_numba.cpu.online_softmax_update`.
"""

import argparse
import math
import pathlib

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from sdpa_numba import scaled_dot_product_attention as sdpa  # noqa: E402
from sdpa_numba.cpu import online_softmax_finalize, online_softmax_update  # noqa: E402

IMG = pathlib.Path(__file__).resolve().parent / "img"
DIMS = [4, 8, 16, 32, 64, 128, 256, 512, 1024]


def scores(q, k, scale):
    """``scale · q[i]·k[i]`` for each pair, computed by sdpa_numba (one key per head)."""
    n, d = q.shape
    v = np.zeros((n, 1, 1), q.dtype)
    _, lse = sdpa(q.reshape(n, 1, d), k.reshape(n, 1, d), v, scale=scale, return_lse=True)
    return lse[:, 0].astype(np.float64)


def probabilities(q, k, scale):
    """Softmax rows ``softmax(scale · q kᵀ)``, computed by sdpa_numba with V = I."""
    return sdpa(q, k, np.eye(k.shape[0], dtype=q.dtype), scale=scale)


def softmax_jacobian_norm(p):
    """Frobenius norm of the softmax Jacobian ``diag(p) - p pᵀ`` of each row of ``p``."""
    # ||diag(p) - p p^T||_F^2 = sum p_i^2 - 2 sum p_i^3 + (sum p_i^2)^2
    s2 = (p**2).sum(axis=-1)
    s3 = (p**3).sum(axis=-1)
    return np.sqrt(np.maximum(s2 - 2 * s3 + s2**2, 0.0))


def figure_variance(rng, n_pairs, path):
    var_raw, var_scaled = [], []
    for d in DIMS:
        q = rng.standard_normal((n_pairs, d), dtype=np.float32)
        k = rng.standard_normal((n_pairs, d), dtype=np.float32)
        var_raw.append(scores(q, k, 1.0).var())
        var_scaled.append(scores(q, k, 1 / math.sqrt(d)).var())
    fig, ax = plt.subplots(figsize=(6.4, 4.4))
    ax.plot(DIMS, DIMS, color="grey", linestyle="--", linewidth=1, label=r"$d_k$ (theory)")
    ax.plot(DIMS, var_raw, "o-", color="C3", linewidth=2, label=r"Var$[q\cdot k]$ (unscaled)")
    ax.plot(DIMS, var_scaled, "s-", color="C0", linewidth=2,
            label=r"Var$[q\cdot k/\sqrt{d_k}]$ (scaled)")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log", base=2)
    ax.set_xticks(DIMS, [str(d) for d in DIMS])
    ax.set_xlabel(r"head dimension $d_k$")
    ax.set_ylabel("variance of the score (measured)")
    ax.set_title(f"Scores of random q, k with N(0, 1) components ({n_pairs} pairs each)")
    ax.grid(True, alpha=0.3, which="both")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return var_raw, var_scaled


def figure_saturation(rng, n_rows, n_keys, path):
    pmax = {"unscaled": [], "scaled": []}
    jac = {"unscaled": [], "scaled": []}
    for d in DIMS:
        q = rng.standard_normal((n_rows, d), dtype=np.float32)
        k = rng.standard_normal((n_keys, d), dtype=np.float32)
        for name, scale in (("unscaled", 1.0), ("scaled", 1 / math.sqrt(d))):
            p = probabilities(q, k, scale).astype(np.float64)
            pmax[name].append(p.max(axis=-1).mean())
            jac[name].append(softmax_jacobian_norm(p).mean())
    fig, (a1, a2) = plt.subplots(2, 1, figsize=(6.8, 8.2), sharex=True)
    for ax, data, ylabel in ((a1, pmax, "mean of the largest probability  max$_j\\,p_j$"),
                             (a2, jac, "mean $\\|\\partial p/\\partial s\\|_F$ (softmax Jacobian)")):
        ax.plot(DIMS, data["unscaled"], "o-", color="C3", linewidth=2,
                label=r"softmax$(q k^\top)$ (unscaled)")
        ax.plot(DIMS, data["scaled"], "s-", color="C0", linewidth=2,
                label=r"softmax$(q k^\top/\sqrt{d_k})$ (scaled)")
        ax.set_xscale("log", base=2)
        ax.set_xticks(DIMS, [str(d) for d in DIMS])
        ax.set_xlabel(r"head dimension $d_k$")
        ax.set_ylabel(ylabel)
        ax.set_ylim(bottom=0)
        ax.grid(True, alpha=0.3)
        ax.legend()
    a1.axhline(1 / n_keys, color="grey", linestyle=":", linewidth=1)
    a1.annotate(f"uniform: 1/{n_keys}", (DIMS[0], 1 / n_keys), textcoords="offset points",
                xytext=(0, 5), color="grey", fontsize=8)
    a1.set_title(f"Saturation: one key takes all ({n_keys} keys, {n_rows} queries)")
    a2.set_title("Vanishing gradient: the Jacobian goes to 0")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return pmax, jac


def figure_online(rng, path, n_keys=256, block=32):
    """One row: scores in blocks, the running max and the running log-sum-exp estimate."""
    s = rng.standard_normal(n_keys) * 3.0
    s[150:160] += 9.0  # a late, larger group: the running max has to move
    v = np.eye(n_keys)  # acc then holds the unnormalized probabilities
    m = np.full(1, -np.inf)
    l = np.zeros(1)
    acc = np.zeros((1, n_keys))
    ms, ls, est = [], [], []
    for j0 in range(0, n_keys, block):
        online_softmax_update(s[None, j0:j0 + block], v[j0:j0 + block], m, l, acc)
        ms.append(m[0])
        ls.append(l[0])
        est.append(m[0] + math.log(l[0]))
    out = np.empty((1, n_keys))
    lse = np.empty(1)
    online_softmax_finalize(m, l, acc, out, lse)
    # The same row through the public function: its lse must be the final estimate.
    f32 = np.float32
    _, lse_api = sdpa(np.ones((1, 1), f32), s[:, None].astype(f32), np.zeros((n_keys, 1), f32),
                      scale=1.0, return_lse=True)
    assert abs(lse_api[0] - lse[0]) < 1e-5 * abs(lse[0]) and abs(out.sum() - 1) < 1e-12

    ends = np.arange(block, n_keys + 1, block)
    fig, (a1, a2) = plt.subplots(2, 1, figsize=(8.5, 6.2), sharex=True,
                                 gridspec_kw={"height_ratios": [3, 2]})
    for b, j0 in enumerate(range(0, n_keys, block)):
        a1.axvspan(j0 - 0.5, j0 + block - 0.5, color="0.93" if b % 2 else "white", zorder=0)
    a1.plot(np.arange(n_keys), s, ".", color="C0", markersize=4, label="scores $s_j$")
    a1.step(np.r_[0, ends] - 0.5, np.r_[ms, ms[-1]], where="post", color="C3", linewidth=2,
            label="running max $m$ once the block is folded in")
    a1.axhline(lse[0], color="C2", linestyle="--", linewidth=1.5,
               label=f"log-sum-exp of the row = {lse[0]:.3f}")
    a1.set_ylabel("score")
    a1.set_title(f"Online softmax over one row of {n_keys} scores, blocks of {block}")
    a1.legend(loc="lower left", fontsize=8)
    a2.plot(ends - 0.5, est, "o-", color="C2", linewidth=2,
            label=r"$m + \log \ell$ after each block")
    a2.axhline(lse[0], color="C2", linestyle="--", linewidth=1)
    a2b = a2.twinx()
    a2b.plot(ends - 0.5, ls, "s:", color="C1",
             label=r"running sum $\ell$ (scaled by $\alpha$ when $m$ moves)")
    a2b.set_ylabel(r"$\ell$", color="C1")
    a2.set_xlabel("key index $j$")
    a2.set_ylabel("log-sum-exp estimate")
    h1, l1 = a2.get_legend_handles_labels()
    h2, l2 = a2b.get_legend_handles_labels()
    a2.legend(h1 + h2, l1 + l2, loc="lower right", fontsize=8)
    a2.grid(True, alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return ms, ls, est, lse[0]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=pathlib.Path, default=IMG, help="folder for the PNGs")
    parser.add_argument("--pairs", type=int, default=20000,
                        help="random q, k pairs per d_k for the variance figure")
    parser.add_argument("--rows", type=int, default=512,
                        help="queries per d_k for the saturation figure")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(2017)
    raw, scaled = figure_variance(rng, args.pairs, args.out / "scaling_variance.png")
    print("d_k, Var[q.k], Var[q.k/sqrt(d_k)]:")
    for d, a, b in zip(DIMS, raw, scaled):
        print(f"  {d:5d} {a:10.2f} {b:6.3f}")
    pmax, jac = figure_saturation(rng, args.rows, 64, args.out / "softmax_saturation.png")
    print("d_k, mean max p (unscaled, scaled), mean ||J||_F (unscaled, scaled):")
    for i, d in enumerate(DIMS):
        print(f"  {d:5d} {pmax['unscaled'][i]:.3f} {pmax['scaled'][i]:.3f}   "
              f"{jac['unscaled'][i]:.4f} {jac['scaled'][i]:.4f}")
    ms, ls, est, lse = figure_online(np.random.default_rng(2018), args.out / "online_softmax.png")
    print(f"online softmax: running max per block {np.round(ms, 2).tolist()}, final lse {lse:.4f}")
    print(f"figures written to {args.out}")


if __name__ == "__main__":
    main()
