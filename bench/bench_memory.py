"""Per-device memory of the compiled jaxdp step, against the ZeRO formulas (GUIDE.md section 4).

Model: a flax MLP, 4 Dense 1024x1024 layers + a 1024x16 head (Psi ~ 4.2M params), created in
float32 and trained with ``param_dtype="bfloat16"`` (bf16 working params, fp32 master weights
owned by the optimizer), Adam, dp = 8 simulated CPU devices, a small global batch (64 x 1024) so
that activations are negligible next to the model state.

Nothing is executed and no parameter is allocated: the params are ``jax.eval_shape`` shapes,
``jax.eval_shape(dp.init, params)`` gives the state's shapes, the step's own ``out_info`` gives
the shardings the engine puts on the state, and ``dp.step.lower(state, batch).compile()
.memory_analysis()`` reports the per-device argument, output, temp and alias bytes of the
SPMD-partitioned program.

Formulas, bytes per device (Psi params, N = dp ranks):

* ZeRO paper (bf16 params and grads, fp32 master + Adam m, v = 12 Psi):
  stage 0 ``16 Psi``, stage 1 ``4 Psi + 12 Psi/N``, stage 2 ``2 Psi + 14 Psi/N``;
* jaxdp accumulates gradients in fp32, so add the fp32 accumulator: ``+4 Psi`` where it is a
  full-size per-device buffer (stages 0 and 1, and stage 2 with one micro-batch, which runs the
  stage-1 code path), ``+4 Psi/N`` where it is sharded (stage 2 with micro-batches).

Run: python bench/bench_memory.py
"""

from __future__ import annotations

import os

import _harness as H

os.environ.update(H.cpu_devices(8))

import math
import re
import time
import warnings
from collections import Counter
from typing import Any

import jax
import jax.numpy as jnp
import optax
from _models import MLP, mse_loss
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxdp

WIDTH, DEPTH, OUT, BATCH = 1024, 4, 16, 64
SMALL_BUCKET = 1_100_000  # a bucket closes about every 1024x1024 kernel: several buckets
MIB = H.MIB


def abstract_params(model: MLP) -> Any:
    return jax.eval_shape(lambda: model.init(jax.random.key(0), jnp.zeros((1, WIDTH)))["params"])


def abstract_batch(mesh) -> dict[str, jax.ShapeDtypeStruct]:
    sh = NamedSharding(mesh, P("data"))
    return {
        "x": jax.ShapeDtypeStruct((BATCH, WIDTH), jnp.float32, sharding=sh),
        "y": jax.ShapeDtypeStruct((BATCH, OUT), jnp.float32, sharding=sh),
    }


def formulas(stage: int, g: int, psi: int, n: int) -> tuple[float, float, str]:
    """(ZeRO paper bytes, paper + fp32 accumulator bytes, which accumulator term applies)."""
    paper = {0: 16 * psi, 1: 4 * psi + 12 * psi / n, 2: 2 * psi + 14 * psi / n}[stage]
    if stage == 2 and g > 1:
        return paper, paper + 4 * psi / n, "+4Ψ/N (sharded fp32 accumulator)"
    why = "+4Ψ (full fp32 accumulator)"
    if stage == 2:
        why += "; G=1 runs the stage-1 path"
    return paper, paper + 4 * psi, why


def _shapes(text: str) -> list[tuple[str, tuple[int, ...], int]]:
    """``(dtype, dims, bytes)`` of every array type written in an HLO snippet."""
    out = []
    for dt, dims in re.findall(r"\b(f32|bf16|f16|f64|s32|pred)\[([\d,]*)\]", text):
        shape = tuple(int(d) for d in dims.split(",") if d)
        out.append((dt, shape, math.prod(shape) * H.ITEMSIZE[dt]))
    return out


def hlo_facts(text: str, params: Any) -> dict[str, str]:
    """What the compiled program does with gradients and params, read from its HLO text.

    * ``collectives``: the largest operand of each gradient/param collective, with the dtype
      the backend actually runs it in;
    * ``loop_f32``: bytes of float32 arrays shaped like a weight matrix (or its transpose)
      carried through the micro-batch ``while`` loop: fp32 copies of the bf16 params;
    * ``dots``: how many dots run in bf16 and in f32.
    """
    psi = sum(x.size for x in jax.tree.leaves(params))
    mats = {x.shape for x in jax.tree.leaves(params) if x.ndim == 2}
    mats |= {s[::-1] for s in mats}
    coll, loop = [], 0
    for line in text.splitlines():
        m = re.search(r"= (.*?) (all-reduce|reduce-scatter|all-gather|all-to-all)\(", line)
        if m:
            dt, _, size = max(_shapes(m.group(1)), key=lambda s: s[2])
            if size >= 1024:  # skip the scalar metric reductions
                coll.append(f"{m.group(2)} {dt} {size / MIB:.1f} MiB")
        m = re.search(r"= \((.*?)\) while\(", line)
        if m:
            loop += sum(b for d, sh, b in _shapes(m.group(1)) if d == "f32" and sh in mats)
    dots = Counter(re.findall(r"= (bf16|f32)\[[\d,]*\]\S* dot\(", text))
    return {
        "collectives": "; ".join(coll),
        "loop_f32": f"{loop / MIB:.1f} MiB ({loop / psi:.1f}Ψ)" if loop else "—",
        "dots": f"{dots['bf16']} / {dots['f32']}",
    }


def measure_one(
    stage: int,
    g: int,
    model: MLP,
    params: Any,
    param_dtype: str | None = "bfloat16",
    bucket_size: Any = "auto",
) -> dict[str, Any]:
    cfg = jaxdp.DDPConfig(
        zero_stage=stage, num_microbatches=g, param_dtype=param_dtype, bucket_size=bucket_size
    )
    dp = jaxdp.DataParallel(mse_loss(model), optax.adam(1e-3), cfg)
    batch = abstract_batch(dp.mesh)
    shapes = jax.eval_shape(dp.init, params)  # carries no shardings ...
    with warnings.catch_warnings():  # ... so this probe cannot use the donated buffers
        warnings.simplefilter("ignore")
        state = dp.step.lower(shapes, batch).out_info[0]  # the step's outputs carry them
    t0 = time.perf_counter()
    compiled = dp.step.lower(state, batch).compile()
    compile_s = time.perf_counter() - t0
    ma = compiled.memory_analysis()
    n = dp.dp
    psi = sum(x.size for x in jax.tree.leaves(params))
    state_bytes = sum(
        math.prod(x.sharding.shard_shape(x.shape)) * x.dtype.itemsize
        for x in jax.tree.leaves(state)
    )
    batch_bytes = sum(
        math.prod(x.sharding.shard_shape(x.shape)) * x.dtype.itemsize for x in batch.values()
    )
    return {
        "stage": stage,
        "g": g,
        "n": n,
        "psi": psi,
        "buckets": len(dp.layout.buckets),
        "arg": ma.argument_size_in_bytes,
        "out": ma.output_size_in_bytes,
        "temp": ma.temp_size_in_bytes,
        "alias": ma.alias_size_in_bytes,
        "state": state_bytes,
        "batch": batch_bytes,
        "compile_s": compile_s,
        **hlo_facts(compiled.as_text(), params),
    }


def _mib(x: float) -> str:
    return f"{x / MIB:.2f}"


def main_table(rows: list[dict[str, Any]]) -> str:
    head = ["stage", "G", "argument", "output", "alias", "temp", "total¹", "ZeRO formula"]
    head += ["formula + fp32 acc", "total ÷ (formula + fp32 acc)", "fp32 accumulator term"]
    out = []
    for r in rows:
        psi = r["psi"]
        total = r["arg"] + r["out"] - r["alias"] + r["temp"]
        paper, adj, why = formulas(r["stage"], r["g"], psi, r["n"])
        cells = [_mib(r[k]) for k in ("arg", "out", "alias", "temp")]
        cells += [f"{_mib(x)} ({x / psi:.2f}Ψ)" for x in (total, paper, adj)]
        out.append([r["stage"], r["g"], *cells, f"{total / adj:.2f}", why])
    return H.table(head, out, "r" * 10 + "l") + (
        "\n\nAll sizes MiB per device. ¹ total = argument + output - alias + temp: the donated "
        "state is aliased to the new state, so it is counted once."
    )


def breakdown_table(rows: list[dict[str, Any]]) -> str:
    head = ["stage", "G", "state measured", "state formula", "ratio", "temp", "temp ÷ Ψ"]
    head += ["dots bf16 / f32", "f32 carried in the micro-batch loop"]
    head += ["gradient/param collectives as compiled"]
    out = []
    for r in rows:
        psi, n = r["psi"], r["n"]
        formula = 2 * psi + 12 * psi / (n if r["stage"] >= 1 else 1)
        measured = r["arg"] - r["batch"]
        ratio, temp = f"{measured / formula:.3f}", f"{r['temp'] / psi:.2f} B"
        out.append([r["stage"], r["g"], _mib(measured), _mib(formula), ratio, _mib(r["temp"])])
        out[-1] += [temp, r["dots"], r["loop_f32"], r["collectives"]]
    return H.table(head, out, "r" * 8 + "ll")


def control_table(rows: list[dict[str, Any]]) -> str:
    head = ["param_dtype", "bucket_size", "buckets", "stage", "G", "state ÷ Ψ", "temp ÷ Ψ"]
    head += ["f32 weight-shaped arrays in the loop carry"]
    keys = ("param_dtype", "bucket_size", "buckets", "stage", "g")
    out = [[*(r[k] for k in keys), f"{(r['arg'] - r['batch']) / r['psi']:.2f} B"] for r in rows]
    for r, row in zip(rows, out, strict=True):
        row += [f"{r['temp'] / r['psi']:.2f} B", r["loop_f32"]]
    return H.table(head, out, "llrrrrrl")


def result(quick: bool = False, plots: str | None = None) -> dict[str, Any]:
    """The tables; ``quick`` (a smoke run) keeps only the fp32 controls the reading quotes."""
    model = MLP(width=WIDTH, depth=DEPTH, out=OUT)
    params = abstract_params(model)
    psi = sum(x.size for x in jax.tree.leaves(params))
    t0 = time.perf_counter()
    cases = [(0, 1), (1, 1), (2, 1), (0, 4), (1, 4), (2, 4)]
    rows = [measure_one(s, g, model, params) for s, g in cases]
    controls = []
    for pdt in (None,) if quick else ("bfloat16", None):
        for bs in ("auto", SMALL_BUCKET):
            for s, g in ((1, 1), (2, 4)) if quick else ((0, 1), (1, 1), (2, 4)):
                r = measure_one(s, g, model, params, param_dtype=pdt, bucket_size=bs)
                label = f"{bs:,}" if isinstance(bs, int) else bs
                r.update(param_dtype=pdt or "float32 (None)", bucket_size=label)
                controls.append(r)
    elapsed = time.perf_counter() - t0
    n = rows[0]["n"]
    head = (
        f"Model: flax MLP {DEPTH}x Dense({WIDTH}) + Dense({OUT}) head, **Ψ = {psi:,}** params, "
        f"param_dtype bfloat16 with fp32 master weights, Adam, dp = N = {n}, global batch "
        f"{BATCH}x{WIDTH} (activations are a few hundred KiB per device), default "
        f"bucket_size ('auto' = 40M elements: one bucket). {len(rows) + len(controls)} "
        f"compilations in {elapsed:.1f} s, nothing executed."
    )
    md = "\n\n".join(
        [
            head,
            main_table(rows),
            "Breakdown: persistent state (argument bytes minus the per-device batch) against "
            "the formula's state part (bf16 params 2Ψ + fp32 master, m, v 12Ψ, the latter "
            "÷N from stage 1); the transient part (temp); what the compiled program carries "
            "and communicates:",
            breakdown_table(rows),
            "Controls: temp with float32 params (`param_dtype=None`: no bf16, so no CPU "
            "bf16-to-f32 rewriting; the fp32 params are their own master at stage 0) and with "
            f"`bucket_size={SMALL_BUCKET:,}` (several buckets):",
            control_table(controls),
        ]
    )
    print(md)
    return {"markdown": md, "rows": rows, "controls": controls, "psi": psi}


def reading(res: dict[str, Any]) -> str:
    psi, f32, small = res["psi"], "float32 (None)", f"{SMALL_BUCKET:,}"
    ctl = {
        (r["param_dtype"], r["bucket_size"], r["stage"], r["g"]): r["temp"] / psi
        for r in res["controls"]
    }
    g4 = [r["temp"] / psi for r in res["rows"] if r["g"] > 1]
    return H.reading(
        "bench_memory",
        auto1=ctl[(f32, "auto", 1, 1)],
        small1=ctl[(f32, small, 1, 1)],
        small2=ctl[(f32, small, 2, 4)],
        g4_lo=min(g4),
        g4_hi=max(g4),
        auto2=ctl[(f32, "auto", 2, 4)],
    )


if __name__ == "__main__":
    result()
