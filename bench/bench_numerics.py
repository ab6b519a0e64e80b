"""Numerics of the gradient reduction against the float64 mean, for N = 8 ... 512 ranks.

Each of ``N`` ranks holds bf16 gradients of mixed magnitudes (eight binades); the reduced mean is
compared with the exact float64 mean. ``N`` ranks are simulated by a vmapped named axis, so any
``N`` runs on one CPU. Three reductions:

* **bf16 ring**: what an NCCL ring does with a bf16 buffer, ``jaxdp.ring_reduce_scatter`` (a
  ``ppermute`` ring rounding to bf16 after every hop), on gradients pre-scaled by ``1/N`` in
  fp32 and rounded once to bf16 (jaxdp's bf16-wire path);
* **fp32 wire**: the public ``reduce_gradients`` with ``grad_reduce_in_fp32=True``, the fp32
  result rounded to bf16;
* **all_to_all + fp32 sum**: ``reduce_gradients`` with
  ``reduce_scatter_with_fp32_accumulation=True`` (bf16 on the wire, fp32 sum, one rounding).

Reported: relative Frobenius error ``||got - mean|| / ||mean||`` and the fraction of elements
that equal the correctly rounded bf16 mean. A log-log plot goes to ``numerics_vs_n.png``.

Run: ``python bench/bench_numerics.py [--quick] [--plots DIR]``.
"""

from __future__ import annotations

import os
import sys

import _harness as H

os.environ.setdefault("JAX_PLATFORMS", "cpu")

from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from jaxdp import BucketLayout, DDPConfig, reduce_gradients, ring_reduce_scatter

BF16 = ml_dtypes.bfloat16
NS = (8, 12, 16, 24, 48, 64, 96, 128, 256, 384, 512)
METHODS = ("bf16 ring", "fp32 wire", "all_to_all + fp32 sum")


def round_to_bf16(x64: np.ndarray) -> np.ndarray:
    """Correctly rounded float64 -> bf16 (nearest, ties to even), without double rounding."""
    mag = np.abs(x64)
    safe = np.where(mag > 0, mag, 1.0)
    ulp = np.exp2(np.floor(np.log2(safe)) - 7)
    k = np.floor(safe / ulp)
    rem = safe / ulp - k
    up = (rem > 0.5) | ((rem == 0.5) & (k % 2 == 1))
    return (np.where(mag > 0, (k + up) * ulp, 0.0) * np.sign(x64)).astype(np.float64)


def gradients(n: int, per_rank: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, per_rank)) * np.exp2(rng.uniform(-4, 4, (1, per_rank)))
    return x.astype(np.float32).astype(BF16)


def _public(x: np.ndarray, **cfg: Any) -> np.ndarray:
    n = x.shape[0]
    config = DDPConfig(zero_stage=1, bucket_size=None, **cfg)
    layout = BucketLayout.from_params({"g": jnp.asarray(x[0])}, config, n)
    out = jax.vmap(lambda g: reduce_gradients({"g": g}, layout, config), axis_name="data")(
        jnp.asarray(x)
    )
    full = layout.from_global_view({"g": out["g"].reshape(-1)})["g"]
    return np.asarray(full.astype(jnp.bfloat16)).astype(np.float64)


def _ring(x: np.ndarray) -> np.ndarray:
    n = x.shape[0]
    pre = (x.astype(np.float32) / np.float32(n)).astype(BF16)  # fp32 pre-scale, one rounding
    out = jax.vmap(lambda v: ring_reduce_scatter(v, "d", n), axis_name="d")(jnp.asarray(pre))
    return np.asarray(out).reshape(-1).astype(np.float64)


def measure(ns: tuple[int, ...], per_rank: int) -> list[dict[str, Any]]:
    rows = []
    for n in ns:
        x = gradients(n, -(-per_rank // n) * n, seed=n)  # a multiple of N (ring chunks)
        mean = x.astype(np.float64).mean(0)
        want = round_to_bf16(mean)
        got = {
            "bf16 ring": _ring(x),
            "fp32 wire": _public(x, grad_reduce_in_fp32=True),
            "all_to_all + fp32 sum": _public(x, reduce_scatter_with_fp32_accumulation=True),
        }
        row: dict[str, Any] = {"N": n}
        for name, g in got.items():
            row[f"{name} err"] = float(np.linalg.norm(g - mean) / np.linalg.norm(mean))
            row[f"{name} exact"] = float(np.mean(g == want))
        row["bf16 rounding err"] = float(np.linalg.norm(want - mean) / np.linalg.norm(mean))
        rows.append(row)
        print(
            f"N={n:4d}  "
            + "  ".join(f"{m}: {row[f'{m} err']:.2e} ({row[f'{m} exact']:.2%})" for m in METHODS),
            flush=True,
        )
    return rows


def plot(rows: list[dict[str, Any]], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ns = [r["N"] for r in rows]
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for m, style in zip(METHODS, ("o-", "s-", "^--"), strict=True):
        ax.plot(ns, [r[f"{m} err"] for r in rows], style, label=m)
    ax.plot(
        ns, [r["bf16 rounding err"] for r in rows], ":", color="gray", label="exact mean in bf16"
    )
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks(ns)
    ax.set_xticklabels([str(n) for n in ns], rotation=45)
    ax.set_xlabel("data-parallel ranks N")
    ax.set_ylabel("relative error vs float64 mean")
    ax.set_title("Gradient reduction of bf16 gradients")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def markdown(res: dict[str, Any]) -> str:
    lines = [
        f"{res['per_rank']:,} bf16 gradient elements per rank, eight binades of magnitude. Error: "
        "relative Frobenius error against the float64 mean (the floor is the exact mean's own "
        "bf16 rounding); in brackets the fraction of elements equal to the correctly rounded "
        "bf16 mean.",
        "",
        "| N | bf16 ring | fp32 wire | all_to_all + fp32 sum | exact mean in bf16 |",
        "|---:|---:|---:|---:|---:|",
    ]
    for r in res["rows"]:
        cells = " | ".join(f"{r[f'{m} err']:.2e} ({r[f'{m} exact']:.1%})" for m in METHODS)
        lines.append(f"| {r['N']} | {cells} | {r['bf16 rounding err']:.2e} |")
    if res.get("plot"):
        lines.append(f"\n![relative error vs N]({res['plot']})")
    return "\n".join(lines)


def result(quick: bool = False, plots: str | None = None) -> dict[str, Any]:
    ns = (8, 12, 24, 64) if quick else NS
    per_rank = 2048 if quick else 8192
    res: dict[str, Any] = {"per_rank": per_rank, "rows": measure(ns, per_rank)}
    path, res["plot"] = H.plot_target(plots, "numerics_vs_n.png")
    plot(res["rows"], path)
    res["markdown"] = markdown(res)
    return res


def reading(res: dict[str, Any]) -> str:
    rows = res["rows"]
    first, last = rows[0], rows[-1]
    exact = all(r["fp32 wire exact"] == r["all_to_all + fp32 sum exact"] == 1.0 for r in rows)
    return H.reading(
        "bench_numerics",
        err0=first["bf16 ring err"],
        n0=first["N"],
        err1=last["bf16 ring err"],
        n1=last["N"],
        exact0=first["bf16 ring exact"],
        exact1=last["bf16 ring exact"],
        fp32="every element correctly rounded at every N" if exact else "see the table",
    )


if __name__ == "__main__":
    args = sys.argv[1:]
    out = args[args.index("--plots") + 1] if "--plots" in args else None
    print(result(quick="--quick" in args, plots=out)["markdown"])
