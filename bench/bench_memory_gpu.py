"""Per-device memory of the step compiled for 8 H100s (compile-only devices, no GPU needed).

Needs the gpu-aot extra. The CPU figures in bench_memory.py are inflated by XLA:CPU, which runs
no bf16 dots and keeps f32 copies of bf16 weights; the GPU compiler does not, so this is the
table to hold against the ZeRO formulas. Nothing executes: XLA's buffer assignment for the
scheduled GPU program is read from ``compiled.memory_analysis()``.

Run: JAX_PLATFORMS=cpu python bench/bench_memory_gpu.py
"""

from __future__ import annotations

import os
import time
from typing import Any

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import optax

from jaxdp import DataParallel, DDPConfig, aot

LAYERS, WIDTH, BATCH, N = 16, 512, 256, 8
SMALL_BUCKET = 1_000_000


def formula(stage: int, g: int, psi: int) -> tuple[float, str]:
    """GUIDE §4 bytes (bf16 params/grads, Adam with fp32 master) + jaxdp's fp32 accumulator."""
    paper = {0: 16 * psi, 1: 4 * psi + 12 * psi / N, 2: 2 * psi + 14 * psi / N}[stage]
    if g == 1:
        return paper, "no accumulator (G=1)"
    if stage == 2:
        return paper + 4 * psi / N, "+4Ψ/N fp32 accumulator shard"
    return paper + 4 * psi, "+4Ψ fp32 accumulator"


def main() -> dict[str, Any]:
    try:
        mesh = aot.h100_mesh(N)
    except Exception as e:  # the gpu-aot extra is missing
        md = f"Skipped: compile-only H100 devices unavailable ({type(e).__name__}: {e})."
        print(md)
        return {"markdown": md}
    loss_fn, params, batch = aot.example_mlp(layers=LAYERS, width=WIDTH, batch=BATCH)
    psi = sum(x.size for x in jax.tree.leaves(params))
    t0 = time.perf_counter()
    rows = [
        "| stage | G | bucket_size | buckets | state B/param | temp B/param | total B/param "
        "| formula B/param | total ÷ formula | formula terms |",
        "|---:|---:|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    for stage in (0, 1, 2):
        for g in (1, 4):
            for bs in ("auto", SMALL_BUCKET):
                cfg = DDPConfig(
                    zero_stage=stage, num_microbatches=g, param_dtype="bfloat16", bucket_size=bs
                )
                dp = DataParallel(loss_fn, optax.adam(1e-3), cfg, mesh=mesh)
                m = aot.compile_step(dp, params, batch).memory_analysis()
                state = m.argument_size_in_bytes
                total = state + m.output_size_in_bytes - m.alias_size_in_bytes
                total += m.temp_size_in_bytes
                want, why = formula(stage, g, psi)
                rows.append(
                    f"| {stage} | {g} | {bs if bs == 'auto' else f'{bs:,}'} "
                    f"| {len(dp.layout.buckets)} | {state / psi:.2f} "
                    f"| {m.temp_size_in_bytes / psi:.2f} | {total / psi:.2f} | {want / psi:.2f} "
                    f"| {total / want:.2f} | {why} |"
                )
    elapsed = time.perf_counter() - t0
    md = "\n".join(
        [
            f"Model: {LAYERS}-layer tanh MLP of width {WIDTH} (`jaxdp.aot.example_mlp`), "
            f"**Ψ = {psi:,}** params, param_dtype bfloat16 with fp32 master weights, Adam, "
            f"dp = N = {N} compile-only H100s, global batch {BATCH}x{WIDTH}, jaxdp's XLA flags. "
            f"{len(rows) - 2} compilations in {elapsed:.1f} s. "
            "State = argument bytes (params, master, optimizer state, batch); total = argument "
            "+ output - aliased + temp.",
            "",
            *rows,
        ]
    )
    print(md)
    return {"markdown": md}


if __name__ == "__main__":
    main()
