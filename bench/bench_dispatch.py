"""Host time per step: what ``DataParallel.step`` costs the Python thread, against bare ``jit``.

A training loop that reads the loss every step waits for the device and then for the host to
dispatch the next step; the host part is what this measures, on one device (dp = 1) so that
the engine's host work is all that differs. Model: an MLP of ``layers`` tiny layers (2 leaves
each), so the device work is small and the per-array costs show.

Two peers, each the bare jitted step (``value_and_grad`` + AdamW, state donated) that a jaxdp
variant should be held to:

* **bare jit, fp32**: ``(params, opt_state)`` in fp32 (3 arrays per parameter with Adam);
* **bare jit, bf16 + fp32 master**: bf16 working params, an fp32 master copy the optimizer
  updates, cast back every step (4 arrays per parameter: what mixed precision needs anyway).

Measured on this machine, per variant (medians over ``n`` calls):

* **dispatch us**: the time ``step(state, batch)`` takes to return (nothing blocks);
* **loop us**: the time per step of a loop that blocks on the loss every step (dispatch +
  device + the gap between them);
* **arrays**: leaves of the state the step takes (and returns).

And read from programs compiled for one compile-only H100 (``jaxdp.aot``, when the ``gpu-aot``
extra is installed), since XLA:CPU keeps collectives over a 1-device group that XLA:GPU
removes: the **kernel launches** of the step (instructions of the entry computation that run
as a thunk: fusions, custom calls, collectives, copies, loops; a GPU host pays a few us for
each), next to the state arrays (each costs the host about ``per_array_us``, measured here on
a jitted identity over many arrays).

Run: ``JAX_PLATFORMS=cpu python bench/bench_dispatch.py [--layers 64] [--n 200]``.
"""

from __future__ import annotations

import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import argparse
import re
import time
from collections import Counter
from typing import Any

import _harness as H
import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxdp
from jaxdp import aot

GOAL = 1.2
# Instructions of an entry computation that launch nothing (bookkeeping, aliases, the second
# half of an async pair).
_FREE = {
    "parameter",
    "constant",
    "get-tuple-element",
    "tuple",
    "bitcast",
    "opt-barrier",
    "after-all",
    "all-reduce-done",
    "all-gather-done",
    "reduce-scatter-done",
    "collective-permute-done",
    "copy-done",
    "async-done",
    "async-update",
}
_OP = re.compile(r"^\s*(?:ROOT )?\S+ = .*? ([a-z][a-z0-9-]*)\(")


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


def _bare_fp32(opt: Any) -> Any:
    def step(state: Any, b: Any) -> Any:
        master, opt_state = state
        loss, g = jax.value_and_grad(_loss)(master, b)
        upd, opt_state = opt.update(g, opt_state, master)
        return (optax.apply_updates(master, upd), opt_state), {"loss": loss}

    return step


def _bare_mixed(opt: Any) -> Any:
    def step(state: Any, b: Any) -> Any:
        params, master, opt_state = state
        loss, g = jax.value_and_grad(_loss)(params, b)
        g = jax.tree.map(lambda x: x.astype(jnp.float32), g)
        upd, opt_state = opt.update(g, opt_state, master)
        master = optax.apply_updates(master, upd)
        params = jax.tree.map(lambda m, p: m.astype(p.dtype), master, params)
        return (params, master, opt_state), {"loss": loss}

    return step


def _bare_state(kind: str, params: Any, opt: Any) -> Any:
    if kind == "fp32":
        return (params, opt.init(params))
    work = jax.tree.map(lambda x: x.astype(jnp.bfloat16), params)
    return (work, params, opt.init(params))


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
    return 1e6 * H.median(dispatch), 1e6 * H.median(loop)


def per_array_us(n: int = 200, sizes: tuple[int, int] = (32, 512)) -> float:
    """Host microseconds per state array: dispatch of a donated, jitted ``x + 1`` over
    ``sizes[1]`` arrays minus over ``sizes[0]``, divided by the difference (median of ``n``)."""
    f = jax.jit(lambda s: [x + 1 for x in s], donate_argnums=0)
    out = []
    for k in sizes:
        s = [jnp.zeros((4,)) for _ in range(k)]
        s = f(s)
        jax.block_until_ready(s)
        ts = []
        for _ in range(n):
            t0 = time.perf_counter()
            s = f(s)
            ts.append(time.perf_counter() - t0)
        jax.block_until_ready(s)
        out.append(1e6 * H.median(ts))
    return (out[1] - out[0]) / (sizes[1] - sizes[0])


VARIANTS = (
    ("jaxdp stage 0", {"zero_stage": 0}, "fp32"),
    ("jaxdp stage 1", {"zero_stage": 1}, "fp32"),
    ("jaxdp stage 0, bf16 params", {"zero_stage": 0, "param_dtype": "bfloat16"}, "bf16"),
    ("jaxdp stage 1, bf16 params", {"zero_stage": 1, "param_dtype": "bfloat16"}, "bf16"),
    ("jaxdp stage 3, bf16 params", {"zero_stage": 3, "param_dtype": "bfloat16"}, "bf16"),
)
PEERS = {"fp32": "bare jit, fp32", "bf16": "bare jit, bf16 + fp32 master"}


def measure(layers: int = 64, width: int = 16, n: int = 200) -> list[dict[str, Any]]:
    """Host times on this machine's first device (see the module docstring)."""
    params = _params(layers, width)
    batch = {"x": jnp.ones((8, width))}
    opt = optax.adamw(1e-3)
    dev = jax.devices()[0]
    rows: list[dict[str, Any]] = []
    for kind, make in (("fp32", _bare_fp32), ("bf16", _bare_mixed)):
        # copies: the bare step donates its state, and params must outlive it for the engines
        state = jax.device_put(jax.tree.map(jnp.copy, _bare_state(kind, params, opt)), dev)
        arrays = len(jax.tree.leaves(state))
        d, lp = _time(jax.jit(make(opt), donate_argnums=0), state, jax.device_put(batch, dev), n)
        rows.append({"variant": PEERS[kind], "dispatch_us": d, "loop_us": lp, "arrays": arrays})
    mesh = jaxdp.make_mesh([dev])
    for name, cfg, peer in VARIANTS:
        dp = jaxdp.DataParallel(_loss, opt, jaxdp.DDPConfig(**cfg), mesh=mesh)
        st = dp.init(params)
        d, lp = _time(dp.step, st, dp.shard_batch(batch), n)
        arrays = len(jax.tree.leaves(st))
        rows.append(
            {"variant": name, "dispatch_us": d, "loop_us": lp, "arrays": arrays, "peer": peer}
        )
    return rows


def kernel_launches(text: str) -> int:
    """Instructions of the optimised HLO's entry computation that launch work (``_FREE``
    excluded)."""
    m = re.search(r"^ENTRY .*?^}", text, re.M | re.S)
    if m is None:
        raise ValueError("no ENTRY computation in the HLO text")
    ops: Counter[str] = Counter()
    for line in m.group(0).splitlines()[1:]:
        hit = _OP.match(line)
        if hit and hit.group(1) not in _FREE:
            ops[hit.group(1)] += 1
    return sum(ops.values())


def launches(layers: int = 64, width: int = 16) -> list[dict[str, Any]]:
    """Kernel launches per step of every variant and peer compiled for one compile-only H100
    (empty without the ``gpu-aot`` extra)."""
    mesh, _ = H.h100_mesh(1)
    if mesh is None:  # the gpu-aot extra is missing
        return []
    params = jax.eval_shape(lambda: _params(layers, width))
    batch = {"x": jax.ShapeDtypeStruct((8, width), jnp.float32)}
    opt = optax.adamw(1e-3)
    rep = NamedSharding(mesh, P())
    rows = []
    for kind, make in (("fp32", _bare_fp32), ("bf16", _bare_mixed)):
        state = jax.eval_shape(lambda p, k=kind: _bare_state(k, p, opt), params)
        abstract = jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=rep), state
        )
        b = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=rep), batch)
        step = jax.jit(make(opt), donate_argnums=0, out_shardings=rep)
        text = step.lower(abstract, b).compile().as_text()
        rows.append({"variant": PEERS[kind], "launches": kernel_launches(text)})
    for name, cfg, _ in VARIANTS:
        dp = jaxdp.DataParallel(_loss, opt, jaxdp.DDPConfig(**cfg), mesh=mesh)
        text = aot.compile_step(dp, params, batch).as_text()
        rows.append({"variant": name, "launches": kernel_launches(text)})
    return rows


def run(layers: int = 64, width: int = 16, n: int = 200) -> dict[str, Any]:
    rows = measure(layers, width, n)
    by_name = {r["variant"]: r for r in rows}
    for r in launches(layers, width):
        by_name[r["variant"]]["launches"] = r["launches"]
    return {"rows": rows, "per_array_us": per_array_us(n), "layers": layers, "width": width}


def markdown(res: dict[str, Any]) -> str:
    rows = res["rows"]
    by_name = {r["variant"]: r for r in rows}
    gpu = all("launches" in r for r in rows)
    lines = [
        f"MLP of {res['layers']} layers x width {res['width']} ({2 * res['layers']} leaves), "
        "AdamW, one device. Host time per state array on this machine (a jitted identity over "
        f"many arrays): {res['per_array_us']:.2f} us.",
        "",
        "| variant | state arrays | dispatch us | vs peer | loop us/step | vs peer | "
        + ("H100 kernel launches | vs peer |" if gpu else ""),
        "|---|---:|---:|---:|---:|---:|" + ("---:|---:|" if gpu else ""),
    ]
    for r in rows:
        peer = by_name[PEERS[r["peer"]]] if "peer" in r else r
        line = (
            f"| {r['variant']} | {r['arrays']} | {r['dispatch_us']:.0f} | "
            f"{r['dispatch_us'] / peer['dispatch_us']:.2f}x | {r['loop_us']:.0f} | "
            f"{r['loop_us'] / peer['loop_us']:.2f}x |"
        )
        if gpu:
            line += f" {r['launches']} | {r['launches'] / peer['launches']:.2f}x |"
        lines.append(line)
    return "\n".join(lines)


def result(quick: bool = False, plots: str | None = None) -> dict[str, Any]:
    """:func:`run` (``quick``: 8 layers, 20 calls) plus its ``"markdown"``."""
    res = run(8, 16, 20) if quick else run()
    res["markdown"] = markdown(res)
    return res


def reading(res: dict[str, Any]) -> str:
    rows = res["rows"]
    by = {r["variant"]: r for r in rows}
    ours = [r for r in rows if "peer" in r]

    def ratio(r: dict[str, Any], key: str) -> float:
        return float(r[key] / by[PEERS[r["peer"]]][key])

    worst = max(ours, key=lambda r: ratio(r, "loop_us"))
    extra = [
        f"{r['variant'][6:]} {r['arrays'] - by[PEERS[r['peer']]]['arrays']:+d}"
        for r in ours
        if r["arrays"] != by[PEERS[r["peer"]]]["arrays"]
    ]
    text = H.reading(
        "bench_dispatch",
        per_array_us=res["per_array_us"],
        extra=", ".join(extra) if extra else "none",
        worst=worst["variant"][6:],
        worst_ratio=ratio(worst, "loop_us"),
    )
    launches = ""
    if all("launches" in r for r in rows):
        launch = "; ".join(f"{r['variant'][6:]} {ratio(r, 'launches'):.2f}x" for r in ours)
        launches = "\n" + H.reading("bench_dispatch", "launches", launch=launch)
    return f"{text}\n{launches}"


def main(argv: list[str] | None = None) -> str:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--layers", type=int, default=64)
    p.add_argument("--width", type=int, default=16)
    p.add_argument("--n", type=int, default=200)
    a = p.parse_args(argv)
    res = run(a.layers, a.width, a.n)
    md = markdown(res)
    print(md)
    return md


if __name__ == "__main__":
    main()
