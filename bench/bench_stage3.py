"""Stage 3 at one rank against the bare step, compiled for one compile-only H100.

Section 13's GPU runs put stage 3 at 1.04x-1.07x of the bare step at dp = 1 (the 303M GPT of
``configs/gpt_300m_gpu.yaml``, cuDNN attention, 8 sequences), where stages 0-2 ran at about
1.00x. With one rank nothing is gathered or reduced (XLA drops collectives over one device), so
what stage 3 adds there is in the program: this benchmark compiles that GPT's step for one
compile-only H100 (the ``gpu-aot`` extra; nothing executes) as

* **bare jit**: ``bench_gpu.py``'s bare step (``bench_gpu.bare_step``: ``jax.jit`` of
  value_and_grad + AdamW, bf16 working params cast from an fp32 master, no collectives),
  compiled with the XLA options of a stage-1 config, which ``bench_gpu.py`` sets for every
  variant;
* **jaxdp stages 0-3** (``param_dtype="bfloat16"``, default ``remat_policy``), with
  ``jaxdp.aot.compile_step``'s options for each config;
* **stage 3, rematerialising**: stage 3 as it was before ``rematerialises``
  (``jaxdp._src.strategy.plan``) left one shard unwrapped: the loss under ``jax.checkpoint``
  with the default policy, the program section 13's stage-3 rows ran;

each with cuDNN's fused attention (``jax.nn.dot_product_attention(implementation="cudnn")``, as
on the GPU) and with XLA's. jax checks the cuDNN library's version before it traces cuDNN
attention and refuses without one; the benchmark answers that check itself
(:func:`cudnn_without_a_gpu`): XLA compiles the custom calls without the library.

Read from each program (the scheduled GPU HLO, loop bodies counted by their trip count):

* **launches**: the kernels and library calls a step runs (fusions, custom calls, copies;
  bitcasts, tuples, parameters and constants are free), and of them the **GEMMs** (cuBLAS calls
  and Triton GEMM fusions), **cuDNN** attention calls and **copies**;
* **non-GEMM GB**: ``bench_remat.traffic``'s estimate (section 11): the bytes read and written
  by every op that is neither a GEMM nor a collective, split by where the op comes from (its
  ``op_name``): **forward**, **backward**, **recomputed** (the forward ops a checkpoint runs
  again in the backward pass: ``rematted_computation``), and the **update** with the rest of
  the step; the **GEMM GB** the same for the GEMMs;
* **peak** (arguments + outputs - aliased + temp, ``memory_analysis()``) and the CPU seconds to
  lower and compile (one process, so only a rough guide).

Run: ``JAX_PLATFORMS=cpu python bench/bench_stage3.py [--quick]``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import sys
import time
from collections.abc import Iterator
from typing import Any

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _harness as H
import jax
import jax.numpy as jnp
import optax
from bench_remat import _COLLECTIVE, _FREE, _GEMM_KINDS, executed, program, traffic

import jaxdp
from jaxdp import DataParallel, DDPConfig, aot
from jaxdp.models import GPT, GPTConfig, next_byte_loss

#: The model of configs/gpt_300m_gpu.yaml (section 13's GPU rows) and its per-device batch.
FULL = {"layers": 24, "width": 1024, "heads": 16, "context": 1024, "sequences": 8}
QUICK = {"layers": 2, "width": 128, "heads": 2, "context": 64, "sequences": 2}
PARTS = ("forward", "backward", "recomputed", "update")


@contextlib.contextmanager
def cudnn_without_a_gpu() -> Iterator[None]:
    """Trace cuDNN fused attention on a machine without the cuDNN library: jax asks the
    library for its version before it lowers the custom call; the answer only picks among
    features this model does not use, and XLA compiles the call without the library."""
    from jax._src.cudnn import fused_attention_stablehlo as fa

    check = fa.check_cudnn_version
    fa.check_cudnn_version = lambda *a, **k: None
    try:
        yield
    finally:
        fa.check_cudnn_version = check


@contextlib.contextmanager
def rematerialising() -> Iterator[None]:
    """Stage 3 checkpointing its loss with one shard too (jaxdp before ``rematerialises``)."""
    from jaxdp._src.strategy import plan

    rule = getattr(plan, "rematerialises", None)  # a tree before it rematerialises anyway
    if rule is None:
        yield
        return
    plan.rematerialises = lambda config, group: config.zero_stage == 3
    try:
        yield
    finally:
        plan.rematerialises = rule


def part_of(name: str) -> str:
    """Which part of the step an op with ``op_name`` ``name`` belongs to (:data:`PARTS`)."""
    if "rematted_computation" in name:
        return "recomputed"
    if "transpose(" in name:
        return "backward"
    if "jvp(" in name:
        return "forward"
    return "update"


def launches(text: str) -> dict[str, float]:
    """Kernel and library launches of a scheduled GPU program, by kind, per step."""
    out = dict.fromkeys(("launches", "gemm", "cudnn", "copy", "collective"), 0.0)
    for (_, _, tail), op, times in executed(*program(text)):
        if op in _FREE or op.endswith("-done"):
            continue
        out["launches"] += times
        if op.startswith(_COLLECTIVE):
            out["collective"] += times
        elif (op == "fusion" and any(k in tail for k in _GEMM_KINDS)) or (
            op == "custom-call" and ("gemm" in tail or "matmul" in tail)
        ):
            out["gemm"] += times
        elif op == "custom-call" and "cudnn" in tail:
            out["cudnn"] += times
        elif op.startswith("copy") or re.search(r"calls=%[\w.\-]*copy", tail):
            out["copy"] += times
    return out


def problem(quick: bool, attention: str) -> tuple[GPT, Any, Any, str]:
    """``(model, abstract params, abstract batch, description)``."""
    size = QUICK if quick else FULL
    cfg = GPTConfig(
        layers=size["layers"],
        width=size["width"],
        heads=size["heads"],
        context=size["context"],
        scan=False,
        attention=attention,
    )
    tokens = jnp.zeros((1, cfg.context), jnp.int32)
    # initialised with XLA's attention (same params): cuDNN's refuses the fp32 init trace
    init = GPT(dataclasses.replace(cfg, attention="xla"))
    params = jax.eval_shape(lambda: init.init(jax.random.key(0), tokens)["params"])
    batch = {"tokens": jax.ShapeDtypeStruct((size["sequences"], cfg.context + 1), jnp.int32)}
    what = (
        f"GPT (`jaxdp.models.GPT`) of {cfg.layers} layers x width {cfg.width}, {cfg.heads} "
        f"heads, context {cfg.context}, unrolled, {size['sequences']} sequences"
    )
    return GPT(cfg), params, batch, what


def compile_variant(variant: str, quick: bool, attention: str) -> tuple[Any, float]:
    """``variant`` (``"bare"``, ``"stage N"`` or ``"stage 3, rematerialising"``) compiled for
    one compile-only H100: ``(compiled, CPU seconds to lower and compile)``."""
    model, params, batch, _ = problem(quick, attention)
    mesh = aot.h100_mesh(1)
    t0 = time.process_time()
    if variant == "bare":
        import bench_gpu

        opt, step = bench_gpu.bare_step(model)
        sh = jax.sharding.SingleDeviceSharding(mesh.devices.flat[0])

        def f32(tree: Any) -> Any:
            return jax.tree.map(
                lambda x: jax.ShapeDtypeStruct(x.shape, jnp.float32, sharding=sh), tree
            )

        state = (f32(params), f32(jax.eval_shape(opt.init, params)))
        b = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh), batch)
        options = jaxdp.xla_compiler_options(
            DDPConfig(zero_stage=1, param_dtype="bfloat16"), dp_size=1
        )
        compiled = jax.jit(step, donate_argnums=0).lower(state, b).compile(options)
    else:
        stage = int(variant.split(",")[0].split()[-1])
        cfg = DDPConfig(zero_stage=stage, param_dtype="bfloat16")
        remat = rematerialising() if "rematerialising" in variant else contextlib.nullcontext()
        with remat:
            dp = DataParallel(
                lambda p, b: next_byte_loss(model, p, b), optax.adamw(1e-4), cfg, mesh=mesh
            )
            compiled = aot.compile_step(dp, params, batch)
    return compiled, time.process_time() - t0


def read(compiled: Any) -> dict[str, float]:
    text = compiled.as_text()
    t = traffic(text, by=part_of)
    row = {k: v for k, v in launches(text).items()}
    row["non-GEMM GB"] = t["all"] / 1e9
    row.update({p: t.get(f"by:{p}", 0.0) / 1e9 for p in PARTS})
    row["GEMM GB"] = t["gemm"] / 1e9
    row["peak GiB"] = H.total_bytes(compiled.memory_analysis()) / H.GIB
    return row


def run(quick: bool = False) -> dict[str, Any]:
    variants = ["bare", "stage 0", "stage 1", "stage 2", "stage 3", "stage 3, rematerialising"]
    attentions = ["xla"] if quick else ["cudnn", "xla"]
    if quick:
        variants = ["bare", "stage 3", "stage 3, rematerialising"]
    rows = []
    for attention in attentions:
        ctx = cudnn_without_a_gpu() if attention == "cudnn" else contextlib.nullcontext()
        with ctx:
            for v in variants:
                compiled, secs = compile_variant(v, quick, attention)
                row = {"attention": attention, "program": v, **read(compiled), "compile s": secs}
                rows.append(row)
                print({k: round(x, 3) if isinstance(x, float) else x for k, x in row.items()})
    return {"what": problem(quick, "xla")[3], "rows": rows}


def markdown(res: dict[str, Any]) -> str:
    head = [
        "attention",
        "program",
        "launches",
        "GEMMs",
        "cuDNN",
        "copies",
        "non-GEMM GB",
        "vs bare",
        "forward",
        "backward",
        "recomputed",
        "update and rest",
        "GEMM GB",
        "peak GiB",
        "compile s",
    ]
    bare = {r["attention"]: r for r in res["rows"] if r["program"] == "bare"}
    body = []
    for r in res["rows"]:
        name = "bare jit" if r["program"] == "bare" else f"jaxdp {r['program']}"
        ratio = r["non-GEMM GB"] / bare[r["attention"]]["non-GEMM GB"]
        body.append(
            [
                r["attention"],
                name,
                f"{r['launches']:.0f}",
                f"{r['gemm']:.0f}",
                f"{r['cudnn']:.0f}",
                f"{r['copy']:.0f}",
                f"{r['non-GEMM GB']:.2f}",
                f"{ratio:.3f}x",
                *(f"{r[p]:.2f}" for p in PARTS),
                f"{r['GEMM GB']:.2f}",
                f"{r['peak GiB']:.2f}",
                f"{r['compile s']:.0f}",
            ]
        )
    return (
        f"{res['what']} per step, G = 1, bf16 working params, fp32 master, AdamW, one "
        "compile-only H100 (dp = 1), jaxdp's XLA options. Launches per step; bytes read + "
        "written in GB (10^9) per step.\n\n" + H.table(head, body, "ll" + "r" * (len(head) - 2))
    )


def result(quick: bool = False, plots: str | None = None) -> dict[str, Any]:
    """:func:`run` plus its ``"markdown"`` (or ``"skipped"`` without the gpu-aot extra)."""
    mesh, why = H.h100_mesh(1)
    if mesh is None:
        return {"skipped": why, "markdown": f"Skipped: {why}.", "rows": []}
    res = run(quick)
    res["markdown"] = markdown(res)
    return res


def reading(res: dict[str, Any]) -> str:
    rows = {(r["attention"], r["program"]): r for r in res.get("rows", [])}
    if not rows:
        return H.reading("bench_stage3", "skipped")
    programs = ("bare", "stage 1", "stage 2", "stage 3", "stage 3, rematerialising")
    if not all((a, p) in rows for a in ("cudnn", "xla") for p in programs):
        return H.reading("bench_stage3", "quick")
    bare, s1, s2, s3, before = (rows["cudnn", p] for p in programs)
    x_bare, _, _, x_s3, x_before = (rows["xla", p] for p in programs)
    extra = before["non-GEMM GB"] - s1["non-GEMM GB"]
    return H.reading(
        "bench_stage3",
        before=before["non-GEMM GB"],
        before_x=before["non-GEMM GB"] / bare["non-GEMM GB"],
        extra=extra,
        extra_ms=extra / 4.8,  # GB / (TB/s) = ms
        before_launches=before["launches"],
        s1_launches=s1["launches"],
        before_gemms=before["gemm"],
        recomputed=before["recomputed"],
        fwd_saved=s1["forward"] - before["forward"],
        bwd_extra=before["backward"] - s1["backward"],
        s3=s3["non-GEMM GB"],
        s3_x=s3["non-GEMM GB"] / bare["non-GEMM GB"],
        s1=s1["non-GEMM GB"],
        s3_launches=s3["launches"],
        bare_launches=bare["launches"],
        s3_gemms=s3["gemm"],
        s3_peak=s3["peak GiB"],
        before_peak=before["peak GiB"],
        bare_peak=bare["peak GiB"],
        peak_over=(s3["peak GiB"] - bare["peak GiB"]) * 1024,
        peak_x=s3["peak GiB"] / bare["peak GiB"],
        s3_c=s3["compile s"],
        before_c=before["compile s"],
        s2_c=s2["compile s"],
        bare_c=bare["compile s"],
        x_before=x_before["non-GEMM GB"],
        x_before_x=x_before["non-GEMM GB"] / x_bare["non-GEMM GB"],
        x_gemm_extra=x_before["gemm"] - x_s3["gemm"],
        x_gemm_gb=x_before["GEMM GB"] - x_s3["GEMM GB"],
        x_before_peak=x_before["peak GiB"],
        x_s3=x_s3["non-GEMM GB"],
        x_s3_gemms=x_s3["gemm"],
        x_s3_peak=x_s3["peak GiB"],
        x_bare_peak=x_bare["peak GiB"],
    )


def main(argv: list[str]) -> None:
    res = result("--quick" in argv)
    print(res["markdown"])
    print()
    print(reading(res))


if __name__ == "__main__":
    main(sys.argv[1:])
