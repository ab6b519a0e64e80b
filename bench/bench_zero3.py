"""ZeRO-3 against the peer a JAX user would pick instead: GSPMD "FSDP" with plain ``jax.jit``.

The peer keeps the fp32 master params, their gradients and the Adam state sharded
``P("data")`` on each leaf's first axis that ``N`` divides (replicated otherwise), casts the
master to bf16 inside the step and lets XLA's SPMD partitioner insert the all-gathers and
reduce-scatters; with ``G > 1`` it sums fp32 gradients over micro-batches in a ``lax.scan``
(the accumulator sharded like the params). Same model, optimizer and batch as jaxdp.

Two tables:

* memory per device on 8 compile-only H100s (needs the ``gpu-aot`` extra; nothing executes,
  XLA's buffer assignment is read from ``memory_analysis()``), jaxdp ``zero_stage=3`` vs the peer;
* step time on 8 simulated CPU devices, jaxdp stages 1 and 3 vs the peer, median of several
  runs after warm-up, measured in the same process.

Run: ``python bench/bench_zero3.py [--quick]``.
"""

from __future__ import annotations

import os
import sys

import _harness as H

os.environ.update(H.cpu_devices(8))

import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxdp
from jaxdp import aot
from jaxdp._src.zero3.dot_operands import name_batched_dot_operands
from jaxdp._src.zero3.remat import gemm_policy

N = 8


def _spec(shape: tuple[int, ...], n: int) -> P:
    for d, size in enumerate(shape):
        if size % n == 0:
            return P(*([None] * d), "data")
    return P()


def gspmd_fsdp_step(loss_fn: Any, optimizer: Any, g: int, mesh: Any, *, remat: bool = False) -> Any:
    """The peer's step: ``(master, opt_state, batch) -> (master, opt_state, loss)``.

    Each bf16 param is constrained to be replicated where it is used (the all-gather of FSDP);
    the partitioner makes the transpose of that a reduce-scatter of its gradient. With
    ``remat`` the loss runs under ``jax.checkpoint`` with the rule of stage 3's default
    ``remat_policy="gemm"`` (:func:`jaxdp._src.zero3.remat.gemm_policy`: GEMM and fused-attention
    outputs, and the operands of batched dots, named by
    :func:`jaxdp._src.zero3.dot_operands.name_batched_dot_operands`), so the backward pass gathers
    the
    params again and recomputes what stage 3 recomputes.
    """
    rep = NamedSharding(mesh, P())

    inner = name_batched_dot_operands(loss_fn) if remat else loss_fn

    def lf(m: Any, mb: Any) -> jax.Array:
        work = jax.tree.map(
            lambda w: jax.lax.with_sharding_constraint(w.astype(jnp.bfloat16), rep), m
        )
        return inner(work, mb)

    if remat:
        lf = jax.checkpoint(lf, policy=gemm_policy)

    def step(master: Any, opt_state: Any, batch: Any) -> Any:
        mbs = jax.tree.map(lambda x: x.reshape(g, x.shape[0] // g, *x.shape[1:]), batch)

        def micro(carry: Any, mb: Any) -> Any:
            acc, tot = carry
            loss, grads = jax.value_and_grad(lf)(master, mb)
            acc = jax.tree.map(lambda a, gr: a + gr.astype(jnp.float32), acc, grads)
            return (acc, tot + loss), None

        acc0 = jax.tree.map(lambda m: jnp.zeros(m.shape, jnp.float32), master)
        (acc, tot), _ = jax.lax.scan(micro, (acc0, jnp.zeros((), jnp.float32)), mbs)
        grads = jax.tree.map(lambda a: a / g, acc)
        updates, opt_state = optimizer.update(grads, opt_state, master)
        return optax.apply_updates(master, updates), opt_state, tot / g

    return step


def peer(
    loss_fn: Any, optimizer: Any, g: int, mesh: Any, params: Any, kind: str = "sharded"
) -> tuple[Any, tuple[Any, Any]]:
    """The jitted GSPMD peer and its (params, optimizer state) shardings. ``kind``:
    ``"replicated"`` (plain data parallelism), ``"sharded"`` (FSDP: every leaf sharded on a
    dimension that divides) or ``"sharded + remat"`` (and stage 3's remat rule)."""
    spec = (lambda x: P()) if kind == "replicated" else (lambda x: _spec(x.shape, N))
    ps = jax.tree.map(lambda x: NamedSharding(mesh, spec(x)), params)
    os_ = jax.tree.map(
        lambda x: NamedSharding(mesh, spec(x)), jax.eval_shape(optimizer.init, params)
    )
    step = jax.jit(
        gspmd_fsdp_step(loss_fn, optimizer, g, mesh, remat=kind == "sharded + remat"),
        in_shardings=(ps, os_, NamedSharding(mesh, P("data"))),
        out_shardings=(ps, os_, NamedSharding(mesh, P())),
        donate_argnums=(0, 1),
    )
    return step, (ps, os_)


def compile_peer(
    loss_fn: Any, optimizer: Any, g: int, mesh: Any, params: Any, batch: Any, kind: str = "sharded"
) -> tuple[Any, float]:
    """:func:`peer` compiled for abstract ``params`` and ``batch``, and its compile seconds."""
    step, (ps, os_) = peer(loss_fn, optimizer, g, mesh, params, kind)
    opt_abs = jax.eval_shape(optimizer.init, params)
    t0 = time.perf_counter()
    compiled = step.lower(
        H.abstract(params, ps),
        H.abstract(opt_abs, os_),
        H.abstract(batch, NamedSharding(mesh, P("data"))),
    ).compile()
    return compiled, time.perf_counter() - t0


def memory(layers: int, width: int, batch: int, bucket: int) -> dict[str, Any]:
    mesh, why = H.h100_mesh(N)
    if mesh is None:
        return {"skipped": why}
    loss_fn, params, data = aot.example_mlp(layers=layers, width=width, batch=batch)
    psi = sum(x.size for x in jax.tree.leaves(params))
    opt = optax.adam(1e-3)
    rows = []
    for g in (1, 4):
        cfg = jaxdp.DDPConfig(
            zero_stage=3, num_microbatches=g, param_dtype="bfloat16", bucket_size=bucket
        )
        try:
            dp = jaxdp.DataParallel(loss_fn, opt, cfg, mesh=mesh)
            m = aot.compile_step(dp, params, data).memory_analysis()
            ours: float | None = H.total_bytes(m) / psi
            nb = len(dp.layout.buckets)
        except NotImplementedError:
            ours, nb = None, 0
        pm = compile_peer(loss_fn, opt, g, mesh, params, data)[0].memory_analysis()
        formula = 16 / N + (4 / N if g > 1 else 0.0)
        theirs = H.total_bytes(pm) / psi
        rows.append({"g": g, "buckets": nb, "jaxdp": ours, "peer": theirs, "formula": formula})
        print(f"G={g}: jaxdp stage 3 {ours} B/param, GSPMD peer {theirs:.2f} B/param")
    return {"psi": psi, "rows": rows, "layers": layers, "width": width, "batch": batch}


def step_time(layers: int, width: int, batch: int, reps: int) -> dict[str, Any]:
    mesh = jaxdp.make_mesh()
    rng = np.random.default_rng(0)
    params = {
        f"layer{i:02d}": {
            "w": jnp.asarray(rng.standard_normal((width, width)) / np.sqrt(width), jnp.float32),
            "b": jnp.zeros((width,), jnp.float32),
        }
        for i in range(layers)
    }

    def loss_fn(p: Any, b: Any) -> jax.Array:
        h = b["x"].astype(jnp.bfloat16)
        for i in range(layers):
            h = jnp.tanh(h @ p[f"layer{i:02d}"]["w"] + p[f"layer{i:02d}"]["b"])
        return jnp.mean(jnp.square(h.astype(jnp.float32) - b["y"]))

    data = {
        "x": jnp.asarray(rng.standard_normal((batch, width)), jnp.float32),
        "y": jnp.asarray(rng.standard_normal((batch, width)), jnp.float32),
    }
    opt = optax.adam(1e-3)
    out: dict[str, float | None] = {}
    for g in (1, 4):
        step, (ps, os_) = peer(loss_fn, opt, g, mesh, params)
        master = jax.device_put(params, ps)
        st = jax.device_put(opt.init(params), os_)
        b = jax.device_put(data, NamedSharding(mesh, P("data")))
        holder = [master, st]

        def run_peer() -> Any:
            holder[0], holder[1], loss = step(holder[0], holder[1], b)  # noqa: B023
            return loss

        out[f"GSPMD peer, G={g}"] = H.median_time(H.repeat(run_peer), reps)
        for stage in (1, 3):
            cfg = jaxdp.DDPConfig(
                zero_stage=stage, num_microbatches=g, param_dtype="bfloat16", bucket_size=None
            )
            key = f"jaxdp zero_stage={stage}, G={g}"
            try:
                dp = jaxdp.DataParallel(loss_fn, opt, cfg, mesh=mesh)
            except NotImplementedError:
                out[key] = None
                continue
            state = [dp.init(params)]
            bb = dp.shard_batch(data)

            def run_ours() -> Any:
                state[0], metrics = dp.step(state[0], bb)  # noqa: B023
                return metrics["loss"]

            out[key] = H.median_time(H.repeat(run_ours), reps)
        print({k: (None if v is None else round(1e3 * v, 2)) for k, v in out.items()})
    return {"times": out, "layers": layers, "width": width, "batch": batch, "reps": reps}


def markdown(res: dict[str, Any]) -> str:
    mem, st = res["memory"], res["step"]
    lines = []
    if "skipped" in mem:
        lines.append(f"Memory: skipped, {mem['skipped']}.")
    else:
        lines += [
            f"**Memory per device, 8 compile-only H100s.** {mem['layers']}-layer tanh MLP of "
            f"width {mem['width']} (`jaxdp.aot.example_mlp`), Ψ = {mem['psi']:,}, bf16 working "
            f"params, fp32 master, Adam, global batch {mem['batch']}. Bytes per parameter "
            "(argument + output - aliased + temp).",
            "",
            "| G | buckets | jaxdp zero_stage=3 | GSPMD peer | jaxdp ÷ peer | 16Ψ/N (+4Ψ/N acc.) |",
            "|---:|---:|---:|---:|---:|---:|",
        ]
        for r in mem["rows"]:
            ours = "—" if r["jaxdp"] is None else f"{r['jaxdp']:.2f}"
            ratio = "—" if r["jaxdp"] is None else f"{r['jaxdp'] / r['peer']:.2f}"
            lines.append(
                f"| {r['g']} | {r['buckets']} | {ours} | {r['peer']:.2f} | {ratio} "
                f"| {r['formula']:.2f} |"
            )
    t = st["times"]
    lines += [
        "",
        f"**Step time, 8 simulated CPU devices** ({st['layers']}-layer MLP of width "
        f"{st['width']}, bf16 working params, Adam, global batch {st['batch']}, one bucket, "
        f"median of {st['reps']} steps after one warm-up step).",
        "",
        "| program | ms / step | ÷ GSPMD peer (same G) |",
        "|---|---:|---:|",
    ]
    for k, v in t.items():
        g = k.rsplit("G=", 1)[1]
        peer = t[f"GSPMD peer, G={g}"]
        if v is None:
            lines.append(f"| {k} | — | — |")
        else:
            lines.append(f"| {k} | {1e3 * v:.2f} | {v / peer:.2f} |")
    return "\n".join(lines)


def result(quick: bool = False, plots: str | None = None) -> dict[str, Any]:
    if quick:
        res = {
            "memory": memory(layers=4, width=128, batch=64, bucket=20_000),
            "step": step_time(layers=2, width=64, batch=64, reps=2),
        }
    else:
        res = {
            "memory": memory(layers=16, width=512, batch=256, bucket=1_000_000),
            "step": step_time(layers=8, width=256, batch=256, reps=7),
        }
    res["markdown"] = markdown(res)
    return res


if __name__ == "__main__":
    print(result(quick="--quick" in sys.argv)["markdown"])
