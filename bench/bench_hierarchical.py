"""Hierarchical data parallelism on 8 compile-only H100s: state per device and bytes per level.

``num_distributed_optimizer_instances = N`` splits the 8 ranks into N instances. Nothing
executes: each step is compiled for 8 compile-only H100s (needs the gpu-aot extra) and read
twice. The optimizer state and master weights per device are summed from the engine's own
state shardings and held against the ZeRO formula (Adam in fp32, fp32 master: 12 bytes per
param over the shard count: dp / N with ``no_shard``, dp with ``optim``); the argument bytes
of ``compiled.memory_analysis()`` (params, master, optimizer state and batch) against the
stage's formula with that shard count. The bytes each rank sends per step, by level (within
an instance, across instances, or over all 8), are read from the collectives of the
optimized program: a ring collective over ``n`` ranks sends ``(n - 1) / n`` of its full
buffer (an all-reduce twice that), and one in the micro-batch loop runs G times.

Run: JAX_PLATFORMS=cpu python bench/bench_hierarchical.py [--quick]
"""

from __future__ import annotations

import math
import os
import re
import sys
import time
from typing import Any

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import _harness as H
import jax
import optax

from jaxdp import DataParallel, DDPConfig, aot
from jaxdp.aot._report import replica_group_size

LAYERS, WIDTH, BATCH, DP = 16, 512, 256, 8
TOLERANCE = 0.05  # the bound on state per device against the formula
_DTYPE = {"bf16": 2, "f16": 2, "f32": 4, "s32": 4, "u32": 4, "f64": 8, "pred": 1, "s8": 1}


def group_size(line: str) -> int:
    """Ranks per replica group of one collective's HLO line (every form XLA prints; every
    rank where none is printed)."""
    return replica_group_size(line) or DP


def bytes_by_level(text: str, g: int) -> dict[int, float]:
    """Bytes one rank sends per step by replica-group size, from an optimized program."""
    out: dict[int, float] = {}
    entry = False
    for line in text.splitlines():
        if line and not line.startswith(" "):
            entry = line.startswith("ENTRY")
        m = re.search(r"= (.*?) (all-gather|reduce-scatter|all-reduce|all-to-all)(-start)?\(", line)
        if not m or re.fullmatch(r"\(?(\w+\[\](, )?)+\)?", m.group(1)):  # scalars: metrics
            continue
        arrays = [(d, int(n)) for d, n in re.findall(r"(\w+)\[(\d+)\]", m.group(1))]
        if m.group(3):  # an async start's shape is (operands, results)
            arrays = arrays[len(arrays) // 2 :] if m.group(2) != "all-reduce" else arrays
        full = sum(n * _DTYPE.get(d, 4) for d, n in arrays)
        n = group_size(line)
        if m.group(2) == "reduce-scatter":
            full *= n  # the results are 1/n of the buffer
        ring = (n - 1) / n * full * (2 if m.group(2) == "all-reduce" else 1)
        out[n] = out.get(n, 0.0) + ring * (1 if entry else g)
    return out


def shard_bytes(tree: Any, shardings: Any) -> int:
    """Bytes one device holds of the (abstract) ``tree`` laid out by ``shardings``."""
    total = 0
    for x, s in zip(jax.tree.leaves(tree), jax.tree.leaves(shardings), strict=True):
        shape = s.shard_shape(x.shape)
        total += math.prod(shape) * x.dtype.itemsize
    return total


def result(quick: bool = False, plots: str | None = None) -> dict[str, Any]:
    mesh, why = H.h100_mesh(DP)
    if mesh is None:
        print(f"Skipped: {why}.")
        return {"markdown": f"Skipped: {why}."}
    loss_fn, params, batch = aot.example_mlp(layers=LAYERS, width=WIDTH, batch=BATCH)
    psi = sum(x.size for x in jax.tree.leaves(params))
    batch_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(batch)) // DP
    layouts = [(1, "no_shard"), (2, "no_shard"), (2, "optim"), (4, "no_shard"), (4, "optim")]
    if quick:
        layouts = [(1, "no_shard"), (2, "optim")]
    rows = [
        "| stage | G | instances N | outer strategy | shards | opt + master B/param "
        "| formula B/param | ratio | state B/param (memory_analysis) | formula | ratio "
        "| sent within instance MiB | across instances MiB | over all 8 MiB |",
        "|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    worst = 0.0
    t0 = time.perf_counter()
    for stage in (1, 2, 3) if not quick else (1, 3):
        for g in (1, 4) if not quick else (4,):
            for n, strategy in layouts:
                cfg = DDPConfig(
                    zero_stage=stage,
                    num_microbatches=g,
                    param_dtype="bfloat16",
                    bucket_size=1_000_000,
                    num_distributed_optimizer_instances=n,
                    outer_dp_sharding_strategy=strategy,
                )
                mesh_n = mesh if n == 1 else list(mesh.devices.ravel())
                dp = DataParallel(loss_fn, optax.adam(1e-3), cfg, mesh=mesh_n)
                compiled = aot.compile_step(dp, params, batch)
                state = jax.eval_shape(dp.init, params)
                sh = dp.state_shardings
                opt = shard_bytes((state.opt_state, state.master), (sh.opt_state, sh.master))
                shards = dp.group.shard_count
                want_opt = 12 * psi / shards
                work = 2 * psi / (shards if stage == 3 else 1)
                got_state = compiled.memory_analysis().argument_size_in_bytes - batch_bytes
                want_state = work + want_opt
                r_opt, r_state = opt / want_opt, got_state / want_state
                worst = max(worst, abs(r_opt - 1), abs(r_state - 1))
                levels = bytes_by_level(compiled.as_text(), g)
                inner = dp.group.inner_size
                within = levels.get(inner, 0.0) if n > 1 else 0.0
                across = levels.get(n, 0.0) if n > 1 else 0.0
                flat = levels.get(DP, 0.0)
                rows.append(
                    f"| {stage} | {g} | {n} | {strategy if n > 1 else '-'} | {shards} "
                    f"| {opt / psi:.3f} | {want_opt / psi:.3f} | {r_opt:.3f} "
                    f"| {got_state / psi:.3f} | {want_state / psi:.3f} | {r_state:.3f} "
                    f"| {within / H.MIB:.1f} | {across / H.MIB:.1f} | {flat / H.MIB:.1f} |"
                )
                print(rows[-1], flush=True)
    elapsed = time.perf_counter() - t0
    md = "\n".join(
        [
            f"Model: {LAYERS}-layer tanh MLP of width {WIDTH} (`jaxdp.aot.example_mlp`), "
            f"**Ψ = {psi:,}** params, bf16 params with fp32 master weights, Adam, dp = {DP} "
            f"compile-only H100s, global batch {BATCH}, bucket_size 1,000,000. "
            f"{len(rows) - 2} compilations in {elapsed:.1f} s. Shards: what the master and "
            "optimizer state are split into (dp / N with `no_shard`, dp with `optim`). "
            "Opt + master: bytes per device of `TrainState.opt_state` and `.master` under the "
            "engine's shardings; formula 12Ψ / shards. State (memory_analysis): argument bytes "
            "less the batch; formula 2Ψ (stage 3: 2Ψ / shards) + 12Ψ / shards. Sent: bytes one "
            "rank sends per step over each level with ring collectives, read from the optimized "
            "program (replica-group sizes: the instance, one rank per instance, all 8; the "
            "micro-batch loop's collectives counted G times). With N = 1 every collective is "
            f"over all 8. Largest deviation from a formula: {worst * 100:.1f}% (bound: "
            f"{TOLERANCE * 100:.0f}%).",
            "",
            *rows,
        ]
    )
    print(md)
    return {"markdown": md, "worst": worst}


def reading(res: dict[str, Any]) -> str:
    if "worst" not in res:
        return H.reading("bench_hierarchical", "skipped")
    w = res["worst"]
    verdict = (
        f"every row is within {TOLERANCE * 100:.0f}% of its formula"
        if w <= TOLERANCE
        else f"a row is {w * 100:.1f}% off its formula (bound {TOLERANCE * 100:.0f}%)"
    )
    return H.reading("bench_hierarchical", worst=f"{w * 100:.1f}%", verdict=verdict)


if __name__ == "__main__":
    result(quick="--quick" in sys.argv[1:])
