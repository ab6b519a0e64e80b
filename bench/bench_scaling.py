"""Scaling: step time and per-device memory vs device count and model size, against plain jit.

For simulated device counts 1, 2, 4, 8 (meshes over the first ``k`` of 8 CPU devices, global
batch ``32 x k``: weak scaling) and for three MLP widths, the same process measures

* plain ``jax.jit`` data parallelism (params replicated, batch sharded ``P("data")``), the peer;
* jaxdp at ZeRO stage 0 and stage 1 (default config: one bucket on models this small);

step time (median of several timed rounds after warm-up) and per-device memory of the compiled
step (``memory_analysis``: arguments + outputs + temporaries - aliased). Everything is reported as
a ratio to plain jit in the same run; absolute CPU times mean little (GUIDE.md section 4), and on
CPU every collective is a synchronous rendezvous of device threads on 2 cores, so adding devices
adds work without adding compute.

Run: ``python bench/bench_scaling.py [--quick] [--plots DIR]``.
"""

from __future__ import annotations

import os
import sys

import _harness as H

os.environ.update(H.cpu_devices(8))

from typing import Any

import bench_step
import jax
import jax.numpy as jnp
from _models import MLP, mse_loss, regression_data

import jaxdp

PER_DEVICE_BATCH = 32
DEPTH = 4


def _memory(variant: bench_step.Variant) -> float:
    lowered = variant.step.lower(variant.state, variant.batch)  # type: ignore[attr-defined]
    return float(H.total_bytes(lowered.compile().memory_analysis()))


def _variants(width: int, devices: int) -> list[bench_step.Variant]:
    mesh = jaxdp.make_mesh(jax.devices()[:devices])
    model = MLP(width=width, depth=DEPTH)
    loss_fn = mse_loss(model)
    data = regression_data(PER_DEVICE_BATCH * devices, width=width)

    def fresh() -> Any:
        return model.init(jax.random.key(0), jnp.zeros((1, width)))["params"]

    return [
        bench_step.plain_jit_variant("plain jit", fresh(), data, loss_fn, mesh, ""),
        bench_step.jaxdp_variant("jaxdp stage 0", fresh(), data, loss_fn, mesh, zero_stage=0),
        bench_step.jaxdp_variant("jaxdp stage 1", fresh(), data, loss_fn, mesh, zero_stage=1),
    ]


def measure(widths: tuple[int, ...], counts: tuple[int, ...], rounds: int, inner: int) -> list:
    rows = []
    for width in widths:
        for k in counts:
            variants = _variants(width, k)
            row: dict[str, Any] = {"width": width, "devices": k}
            for v in variants:
                row[f"{v.name} ms"] = 1e3 * H.median_time(v.run, rounds, inner, warmup=2)
                row[f"{v.name} MiB"] = _memory(v) / 2**20
            params = sum(x.size for x in jax.tree.leaves(variants[0].state[0]))
            row["params"] = params
            rows.append(row)
            print(
                f"width {width:4d} devices {k}: "
                + "  ".join(
                    f"{n}: {row[f'{n} ms']:.1f} ms {row[f'{n} MiB']:.2f} MiB"
                    for n in ("plain jit", "jaxdp stage 0", "jaxdp stage 1")
                ),
                flush=True,
            )
    return rows


def plot(rows: list[dict[str, Any]], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(9, 3.8))
    for width in sorted({r["width"] for r in rows}):
        sub = [r for r in rows if r["width"] == width]
        ks = [r["devices"] for r in sub]
        for name, style in (("jaxdp stage 0", "o-"), ("jaxdp stage 1", "s--")):
            axes[0].plot(
                ks,
                [r[f"{name} ms"] / r["plain jit ms"] for r in sub],
                style,
                label=f"{name}, width {width}",
            )
            axes[1].plot(
                ks,
                [r[f"{name} MiB"] / r["plain jit MiB"] for r in sub],
                style,
                label=f"{name}, width {width}",
            )
    for ax, what in zip(axes, ("step time", "per-device memory"), strict=True):
        ax.axhline(1.0, color="gray", lw=0.8)
        ax.set_xscale("log", base=2)
        ax.set_xticks([1, 2, 4, 8])
        ax.set_xticklabels(["1", "2", "4", "8"])
        ax.set_xlabel("simulated CPU devices")
        ax.set_ylabel(f"{what} / plain jit")
        ax.grid(True, alpha=0.3)
    axes[1].legend(fontsize=7)
    fig.suptitle("jaxdp vs plain jit data parallelism, same run")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def markdown(res: dict[str, Any]) -> str:
    lines = [
        f"MLP of {DEPTH} hidden layers (f32, AdamW), global batch {PER_DEVICE_BATCH} x devices; "
        f"median of {res['rounds']} rounds of {res['inner']} steps. Ratios to plain jit in the "
        "same run (below 1 is faster / smaller).",
        "",
        "| width | params | devices | plain jit ms | stage 0 time | stage 1 time "
        "| plain jit MiB/device | stage 0 memory | stage 1 memory |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in res["rows"]:
        p = r["plain jit ms"]
        pm = r["plain jit MiB"]
        lines.append(
            f"| {r['width']} | {r['params']:,} | {r['devices']} | {p:.1f} "
            f"| {r['jaxdp stage 0 ms'] / p:.2f}x | {r['jaxdp stage 1 ms'] / p:.2f}x "
            f"| {pm:.2f} | {r['jaxdp stage 0 MiB'] / pm:.2f}x "
            f"| {r['jaxdp stage 1 MiB'] / pm:.2f}x |"
        )
    if res.get("plot"):
        lines.append(f"\n![scaling vs plain jit]({res['plot']})")
    return "\n".join(lines)


def result(quick: bool = False, plots: str | None = None) -> dict[str, Any]:
    widths = (128,) if quick else (128, 256, 512)
    counts = (1, 8) if quick else (1, 2, 4, 8)
    rounds, inner = (2, 2) if quick else (7, 3)
    res: dict[str, Any] = {
        "rows": measure(widths, counts, rounds, inner),
        "rounds": rounds,
        "inner": inner,
    }
    path, res["plot"] = H.plot_target(plots, "scaling.png")
    plot(res["rows"], path)
    res["markdown"] = markdown(res)
    return res


def reading(res: dict[str, Any]) -> str:
    def span(devices: int, key: str, unit: str) -> str:
        rows = [r for r in res["rows"] if r["devices"] == devices]
        vals = [r[f"jaxdp {key} {unit}"] / r[f"plain jit {unit}"] for r in rows]
        return f"{min(vals):.2f}x-{max(vals):.2f}x"

    return H.reading(
        "bench_scaling",
        **{
            f"{unit.lower()}{k}_{s}": span(k, f"stage {s}", unit)
            for k in (1, 8)
            for s in (0, 1)
            for unit in ("ms", "MiB")
        },
    )


if __name__ == "__main__":
    args = sys.argv[1:]
    out = args[args.index("--plots") + 1] if "--plots" in args else None
    print(result(quick="--quick" in args, plots=out)["markdown"])
