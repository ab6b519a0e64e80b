"""Per-device memory of the step compiled for 8 H100s (compile-only devices, no GPU needed).

Needs the gpu-aot extra. The CPU figures in bench_memory.py are inflated by XLA:CPU, which runs
no bf16 dots and keeps f32 copies of bf16 weights; the GPU compiler does not, so this is the
table to hold against the ZeRO formulas. Nothing executes: XLA's buffer assignment for the
scheduled GPU program is read from ``compiled.memory_analysis()``.

The second table is ``DDPConfig.optimizer_cpu_offload``: the same step with the master weights
and Adam's moments in pinned host memory. Compile-only devices have no memories, so jax drops
memory kinds on them; both columns of that table are compiled by ``jaxdp.aot.cross_compile_step``
(lowered on 8 CPU devices, compiled for the 8 compile-only H100s), which keeps the host
transfers, and ``memory_analysis()`` reports device and host bytes apart.

Run: JAX_PLATFORMS=cpu python bench/bench_memory_gpu.py [--quick] (``--quick``: the goal's
rows only)
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import _harness as H

os.environ.update(H.cpu_devices(N := 8))  # the CPU mesh cross_compile_step lowers on
import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxdp import DataParallel, DDPConfig, aot

LAYERS, WIDTH, BATCH = 16, 512, 256
SMALL_BUCKET = 1_000_000
GOAL = 1.10


def formula(stage: int, psi: int) -> float:
    """GUIDE §4 bytes: bf16 params and gradients, Adam with an fp32 master copy."""
    return {0: 16 * psi, 1: 4 * psi + 12 * psi / N, 2: 2 * psi + 14 * psi / N, 3: 16 * psi / N}[
        stage
    ]


def allowance(stage: int, g: int, psi: int, activations: int, bucket: int) -> tuple[float, str]:
    """What no implementation avoids: activations, two buckets of in-flight bf16 gradients and,
    with micro-batches, the fp32 accumulator the stage keeps (full at 0-1, sharded at 2-3)."""
    extra = activations + 2 * 2 * bucket
    why = "act. + 2 bf16 buckets"
    if g > 1:
        extra += 4 * psi if stage <= 1 else 4 * psi / N
        why += " + 4Ψ acc." if stage <= 1 else " + 4Ψ/N acc."
    return extra, why


def activations(loss_fn: Any, params: Any, batch: Any, g: int) -> int:
    """Temp bytes of the plain single-device ``jax.grad`` of one micro-batch (bf16 params),
    compiled for one H100: the activations and scratch any data-parallel step also has."""
    mesh = aot.h100_mesh(1)
    dev = NamedSharding(mesh, P())
    work = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, jnp.bfloat16, sharding=dev), params)
    local = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(
            (x.shape[0] // (N * g), *x.shape[1:]), x.dtype, sharding=dev
        ),
        batch,
    )
    compiled = jax.jit(jax.grad(loss_fn)).lower(work, local).compile()
    return int(compiled.memory_analysis().temp_size_in_bytes)


def _configs(quick: bool = False) -> list[tuple[int, int, Any, bool]]:
    """Every stage x G with one bucket and with several (the goal's rows), and with the
    parameter gather overlapped; ``quick``: only the goal's rows."""
    out = []
    for stage in (0, 1, 2, 3):
        for g in (1, 4):
            for bs in ("auto", SMALL_BUCKET):
                if not (quick and bs == "auto"):
                    out.append((stage, g, bs, False))
            if stage in (1, 2) and not quick:
                out.append((stage, g, SMALL_BUCKET, True))
    return out


def _state_bytes(dp: DataParallel) -> tuple[int, int]:
    """Per device: the bytes of the master weights and optimizer state, and those of the
    largest bucket's share of them."""
    state, shardings = dp.abstract_state, dp.state_shardings
    total = 0
    for x, sh in zip(
        jax.tree.leaves((state.master, state.opt_state)),
        jax.tree.leaves((shardings.master, shardings.opt_state)),
        strict=True,
    ):
        shard = sh.shard_shape(x.shape)
        n = 1
        for d in shard:
            n *= d
        total += n * x.dtype.itemsize
    numels = [b.numel for b in dp.layout.buckets]
    return total, total * max(numels) // sum(numels)


def offload_rows(loss_fn: Any, params: Any, batch: Any, mesh: Any, quick: bool) -> list[str]:
    """Device and host bytes per device with and without ``optimizer_cpu_offload``, both
    cross-compiled (module docstring); the check: the device bytes drop by the optimizer
    state's bytes, less what is in flight (counted in buckets' shares of the state)."""
    cpu = jax.make_mesh((N,), ("data",), devices=jax.devices("cpu")[:N])
    targets = list(mesh.devices.flat)
    rows = [
        "| stage | buckets | device B/param (on device) | device B/param (offload) "
        "| host B/param (offload) | opt. state B/param | drop B/param "
        "| one bucket's state B/param | (state - drop) in buckets |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    psi = sum(x.size for x in jax.tree.leaves(params))
    for stage in (1, 3) if quick else (0, 1, 2, 3):
        got = {}
        for off in (False, True):
            cfg = DDPConfig(
                zero_stage=stage,
                param_dtype="bfloat16",
                bucket_size=SMALL_BUCKET,
                optimizer_cpu_offload=off,
            )
            dp = DataParallel(loss_fn, optax.adam(1e-3), cfg, mesh=cpu)
            m = aot.cross_compile_step(dp, params, batch, targets).memory_analysis()
            host = m.host_argument_size_in_bytes + m.host_temp_size_in_bytes
            got[off] = (H.total_bytes(m), host, dp)
        state, bucket = _state_bytes(got[True][2])
        drop = got[False][0] - got[True][0]
        rows.append(
            f"| {stage} | {len(got[True][2].layout.buckets)} | {got[False][0] / psi:.2f} "
            f"| {got[True][0] / psi:.2f} | {got[True][1] / psi:.2f} | {state / psi:.2f} "
            f"| {drop / psi:.2f} | {bucket / psi:.2f} | {(state - drop) / bucket:.1f} |"
        )
        print(rows[-1], flush=True)
    return rows


def result(quick: bool = False, plots: str | None = None) -> dict[str, Any]:
    mesh, why = H.h100_mesh(N)
    if mesh is None:
        print(f"Skipped: {why}.")
        return {"markdown": f"Skipped: {why}."}
    loss_fn, params, batch = aot.example_mlp(layers=LAYERS, width=WIDTH, batch=BATCH)
    psi = sum(x.size for x in jax.tree.leaves(params))
    t0 = time.perf_counter()
    act = {g: activations(loss_fn, params, batch, g) for g in (1, 4)}
    rows = [
        "| stage | G | bucket_size | overlap_param_gather | buckets | state B/param "
        "| temp B/param | total B/param | formula B/param | allowance B/param "
        "| total ÷ (formula + allowance) | allowance terms |",
        "|---:|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    ratios: dict[tuple[int, int], float] = {}
    for stage, g, bs, overlap in _configs(quick):
        extra = {"overlap_param_gather": True} if overlap else {}
        try:
            cfg = DDPConfig(
                zero_stage=stage,
                num_microbatches=g,
                param_dtype="bfloat16",
                bucket_size=bs,
                **extra,
            )
            dp = DataParallel(loss_fn, optax.adam(1e-3), cfg, mesh=mesh)
        except (NotImplementedError, TypeError):
            continue  # a feature this checkout does not have
        m = aot.compile_step(dp, params, batch).memory_analysis()
        state, total = m.argument_size_in_bytes, H.total_bytes(m)
        biggest = max(b.numel_unpadded for b in dp.layout.buckets)
        want = formula(stage, psi)
        allow, why = allowance(stage, g, psi, act[g], biggest)
        ratio = total / (want + allow)
        if bs == SMALL_BUCKET and not overlap:
            ratios[(stage, g)] = ratio
        rows.append(
            f"| {stage} | {g} | {bs if bs == 'auto' else f'{bs:,}'} | {overlap} "
            f"| {len(dp.layout.buckets)} | {state / psi:.2f} "
            f"| {m.temp_size_in_bytes / psi:.2f} | {total / psi:.2f} | {want / psi:.2f} "
            f"| {allow / psi:.2f} | {ratio:.2f} | {why} |"
        )
        print(rows[-1], flush=True)
    elapsed = time.perf_counter() - t0
    t1 = time.perf_counter()
    offload = offload_rows(loss_fn, params, batch, mesh, quick)
    offload_s = time.perf_counter() - t1
    md = "\n".join(
        [
            f"Model: {LAYERS}-layer tanh MLP of width {WIDTH} (`jaxdp.aot.example_mlp`), "
            f"**Ψ = {psi:,}** params, param_dtype bfloat16 with fp32 master weights, Adam, "
            f"dp = N = {N} compile-only H100s, global batch {BATCH}x{WIDTH}, jaxdp's XLA flags. "
            f"{len(rows) - 2} compilations in {elapsed:.1f} s. "
            "State = argument bytes (params, master, optimizer state, batch); total = argument "
            "+ output - aliased + temp. Formula: GUIDE §4 (stage 0 16Ψ, 1 4Ψ + 12Ψ/N, "
            "2 2Ψ + 14Ψ/N, 3 16Ψ/N). Allowance: activations (the temp bytes of the plain "
            f"single-device `jax.grad` of one micro-batch on one H100: {act[1] / psi:.2f} B/param "
            f"at G = 1, {act[4] / psi:.2f} at G = 4), two buckets of in-flight bf16 gradients "
            "(the largest bucket) and, at G > 1, the fp32 accumulator the stage keeps. "
            f"Goal: total ÷ (formula + allowance) <= {GOAL} on the several-bucket rows.",
            "",
            *rows,
            "",
            f"**Optimizer CPU offload** (`optimizer_cpu_offload=True`, {offload_s:.1f} s): the "
            f"same model and batch, bucket_size {SMALL_BUCKET:,}, G = 1, Adam; both columns "
            "compiled by `jaxdp.aot.cross_compile_step` (lowered on 8 CPU devices, compiled "
            "for the 8 compile-only H100s: on compile-only devices jax drops memory kinds). "
            "Device = argument + output - aliased + temp device bytes; host = host argument + "
            "host temp bytes; opt. state = the master weights and Adam's moments per device; "
            "drop = device bytes on device - with offload; one bucket = the largest bucket's "
            "share of that state; the last column: what of the state is still on the device "
            "at the peak, in buckets (the bucket in flight each way).",
            "",
            *offload,
        ]
    )
    print(md)
    return {"markdown": md, "ratios": ratios, "psi": psi, "offload": offload[2:]}


def reading(res: dict[str, Any]) -> str:
    ratios = res.get("ratios")
    if not ratios:
        return H.reading("bench_memory_gpu", "skipped")
    over = [f"stage {s} at G = {g}" for (s, g), r in sorted(ratios.items()) if r > GOAL]
    cells = ", ".join(
        f"stage {row.split('|')[1].strip()}: {row.split('|')[-2].strip()}"
        for row in res.get("offload", [])
    )
    return H.reading(
        "bench_memory_gpu",
        cells=", ".join(f"stage {s} G = {g}: {r:.2f}x" for (s, g), r in sorted(ratios.items())),
        verdict=f"above the 1.10x goal: {', '.join(over)}"
        if over
        else "every row is within the 1.10x goal",
    ) + ("\n\n" + H.reading("bench_memory_gpu", "offload", cells=cells) if cells else "")


if __name__ == "__main__":
    result(quick="--quick" in sys.argv[1:])
