"""Host time per step: what ``DataParallel.step`` costs the Python thread, against bare ``jit``.

A training loop that reads the loss every step waits for the device and then for the host to
dispatch the next step; the host part is what this measures, on one device (dp = 1, every
collective a no-op) so that the engine's host work is all that differs. Model: an MLP of
``layers`` tiny layers (2 leaves each), so the device work is small and the per-array costs
show. For each variant:

* **dispatch us**: the time ``step(state, batch)`` takes to return (asynchronous dispatch,
  nothing blocks), median over ``n`` calls in a row;
* **loop us**: the time per step of a loop that blocks on the loss every step (dispatch +
  device + the gap between them), median;
* **arrays**: leaves of the state the step takes and returns.

Variants: ``bare`` (``jax.jit`` of value_and_grad + AdamW on ``(master, opt_state)``, fp32),
``jaxdp`` at stages 0 and 1 (fp32 params: no master copy at stage 0), and ``jaxdp bf16`` at
stage 1 (bf16 working params + fp32 master: one more array per parameter, as the bare step
would need for mixed precision too).

Run: ``JAX_PLATFORMS=cpu python bench/bench_dispatch.py [--layers 64] [--n 200]``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from typing import Any

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import jax.numpy as jnp
import optax

import jaxdp


def _params(layers: int, width: int) -> dict[str, Any]:
    k = jax.random.key(0)
    return {
        f"l{i}": {
            "w": jax.random.normal(jax.random.fold_in(k, i), (width, width)) / width**0.5,
            "b": jnp.zeros((width,)),
        }
        for i in range(layers)
    }


def _loss(p: Any, b: Any) -> jax.Array:
    x = b["x"]
    for i in range(len(p)):
        x = jnp.tanh(x @ p[f"l{i}"]["w"].astype(x.dtype) + p[f"l{i}"]["b"].astype(x.dtype))
    return jnp.mean(x.astype(jnp.float32) ** 2)


def _time(step: Any, state: Any, batch: Any, n: int) -> tuple[float, float]:
    state, m = step(state, batch)  # compile
    jax.block_until_ready((state, m))
    dispatch = []
    for _ in range(n):
        t0 = time.perf_counter()
        state, m = step(state, batch)
        dispatch.append(time.perf_counter() - t0)
    jax.block_until_ready((state, m))
    loop = []
    for _ in range(n):
        t0 = time.perf_counter()
        state, m = step(state, batch)
        float(m["loss"] if isinstance(m, dict) else m)
        loop.append(time.perf_counter() - t0)
    return 1e6 * statistics.median(dispatch), 1e6 * statistics.median(loop)


def run(layers: int = 64, width: int = 16, n: int = 200) -> list[dict[str, Any]]:
    params = _params(layers, width)
    batch = {"x": jnp.ones((8, width))}
    opt = optax.adamw(1e-3)
    dev = jax.devices()[0]

    def bare(state: Any, b: Any) -> Any:
        master, opt_state = state
        loss, g = jax.value_and_grad(_loss)(master, b)
        upd, opt_state = opt.update(g, opt_state, master)
        return (optax.apply_updates(master, upd), opt_state), {"loss": loss}

    # copies: the bare step donates its state, and params must outlive it for the engines
    state = jax.device_put(jax.tree.map(jnp.copy, (params, opt.init(params))), dev)
    rows: list[dict[str, Any]] = []
    d, lp = _time(jax.jit(bare, donate_argnums=0), state, jax.device_put(batch, dev), n)
    arrays = len(jax.tree.leaves(state))
    rows.append({"variant": "bare jit", "dispatch_us": d, "loop_us": lp, "arrays": arrays})
    mesh = jaxdp.make_mesh([dev])
    for name, cfg in (
        ("jaxdp stage 0", jaxdp.DDPConfig(zero_stage=0)),
        ("jaxdp stage 1", jaxdp.DDPConfig(zero_stage=1)),
        ("jaxdp stage 1, bf16 params", jaxdp.DDPConfig(zero_stage=1, param_dtype="bfloat16")),
    ):
        dp = jaxdp.DataParallel(_loss, opt, cfg, mesh=mesh)
        st = dp.init(params)
        d, lp = _time(dp.step, st, dp.shard_batch(batch), n)
        rows.append(
            {"variant": name, "dispatch_us": d, "loop_us": lp, "arrays": len(jax.tree.leaves(st))}
        )
    return rows


def markdown(rows: list[dict[str, Any]]) -> str:
    base = rows[0]
    lines = [
        "| variant | state arrays | dispatch us | vs bare | loop us/step | vs bare |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['variant']} | {r['arrays']} | {r['dispatch_us']:.0f} | "
            f"{r['dispatch_us'] / base['dispatch_us']:.2f}x | {r['loop_us']:.0f} | "
            f"{r['loop_us'] / base['loop_us']:.2f}x |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> str:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--layers", type=int, default=64)
    p.add_argument("--width", type=int, default=16)
    p.add_argument("--n", type=int, default=200)
    a = p.parse_args(argv)
    md = markdown(run(a.layers, a.width, a.n))
    print(md)
    return md


if __name__ == "__main__":
    main()
