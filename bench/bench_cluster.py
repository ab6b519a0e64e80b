"""Planning figures for clusters: per-step data-parallel communication time, flat against
hierarchical, at 1 to 64 nodes of 8 GPUs, from the bytes of compiled programs and a link model.

No multi-node machine is available here, so the figures are predictions: the bytes every
gradient and parameter collective moves are read from the step compiled for 8 compile-only
H100s (the 304M GPT of ``configs/gpt_300m_gpu.yaml``, blocks scanned so that it compiles in
about a minute; scanning changes which arrays are combined, not the bytes), and priced with the
alpha-beta model of :mod:`jaxdp._src.topology.links` (written out in the section this writes).

Levels:

* **flat**: one ring over all ``8 m`` GPUs for each collective; across nodes every byte moves
  at the network's rate (:func:`~jaxdp._src.topology.links.ring_link`);
* **hierarchical** (Megatron's ``num_distributed_optimizer_instances = m``, one instance per
  node, ``outer_dp_sharding_strategy="no_shard"``): each gradient collective is reduce-scattered
  over the node's 8 GPUs (NVLink), and its 1/8 shard all-reduced over the ``m`` nodes (one ring
  per GPU, each over its own NIC); parameters are gathered within the node only.

The hierarchical levels at 8 GPUs per node are derived from the flat program's collectives:
the inner reduce-scatter moves what the flat one moves, the outer all-reduce 1/8 of it. This
machine has 8 compile-only devices, so a compiled hierarchical program has instances of 4:
:func:`check_derivation` compiles one (``num_distributed_optimizer_instances=2``) and holds its
levels (:func:`levels_of_program`, by replica-group size) against the same derivation.

The 7B GPT is not compiled (too heavy for this machine): its bytes are its parameter count
times the wire dtype, in as many buckets as Megatron's default size gives it; the 304M
program shows that the compiled bytes are exactly that (the ratio is printed).

Stage 3 is derived from stage 1's collectives: per step it gathers the parameters twice (the
forward pass and again in the backward pass) and reduce-scatters the gradients once.

    python bench/bench_cluster.py            # prints the section
    python bench/run_all.py --only cluster   # writes it into BENCHMARKS.md
"""

from __future__ import annotations

import math
import os
import sys
import time
from typing import Any

import _harness as H

os.environ.update(H.cpu_devices(8))

import jax
import jax.numpy as jnp
import optax

sys.path.insert(0, H.ROOT)
from jaxdp import DataParallel, DDPConfig, default_bucket_size
from jaxdp._src.topology.links import (
    INFINIBAND,
    LATENCY_SHARE,
    NVLINK,
    collective_time,
    ring_link,
)
from jaxdp.aot._hlo import _DTYPE_BYTES, _arrays, _base_kind, _computations
from jaxdp.aot._report import replica_group_size
from jaxdp.models.gpt import GPT, GPTConfig, next_byte_loss

NODES = (1, 2, 4, 16, 64)
PER_NODE = 8
PARAMS_7B = 6_738_415_616  # Llama-2-7B's count, for a 7B GPT of the same size
WIRES = {"bf16": 2, "fp32": 4}


# ---------------------------------------------------------------------- the program reader
def group_size(attrs: str, devices: int) -> int:
    """Ranks per replica group of a collective's attributes (every form XLA prints:
    :func:`jaxdp.aot._report.replica_group_size`; the mesh form counts the named axes only),
    ``devices`` when none is given (all of them)."""
    return replica_group_size(attrs) or devices


def collectives_of(text: str, devices: int) -> list[tuple[str, int, int, int]]:
    """``(kind, full bytes, group size, operands)`` of every collective in ENTRY: the bytes
    of the whole buffer (a reduce-scatter's or all-reduce's input, an all-gather's output)."""
    _, comps = _computations(text)
    out = []
    for _name, entry, body in comps:
        if not entry:
            continue
        shapes = {i.name: i.shape for i in body}
        for ins in body:
            kind, suffix = _base_kind(ins.opcode)
            if kind is None or suffix == "-done":
                continue
            arrays = [a for op in ins.operands for a in _arrays(shapes.get(op, ""))]
            nbytes = sum(e * _DTYPE_BYTES[d] for d, e in arrays)
            n = group_size(ins.attrs, devices)
            out.append((kind, nbytes * n if kind == "all-gather" else nbytes, n, len(arrays)))
    return out


def levels_of_program(text: str, devices: int, per_node: int) -> dict[str, list[tuple[str, int]]]:
    """The collectives of a compiled step by level: ``"inner"`` (groups within a node),
    ``"outer"`` (groups across nodes, e.g. one rank per node) and ``"flat"`` (groups of all the
    data-parallel ranks), each as ``(kind, full bytes)``; scalars (the loss, the norm) left out.

    A flat program has only ``"flat"`` collectives. A hierarchical one (compiled with
    ``num_distributed_optimizer_instances``) is read here as it is: its inner reduce-scatters
    and its outer all-reduces (or reduce-scatters) of the inner shards, by group size."""
    levels: dict[str, list[tuple[str, int]]] = {"inner": [], "outer": [], "flat": []}
    for kind, nbytes, n, _ in collectives_of(text, devices):
        if nbytes < 1024:
            continue
        level = "flat" if n == devices else "inner" if n == per_node else "outer"
        levels[level].append((kind, nbytes))
    return levels


# ---------------------------------------------------------------------- the model
def flat_time(colls: list[tuple[str, int]], nodes: int) -> tuple[float, float]:
    """``(latency, transfer)`` of ``colls`` each as one ring over every GPU."""
    link, n = ring_link(nodes, PER_NODE), nodes * PER_NODE
    parts = [collective_time(k, b, n, link) for k, b in colls]
    return sum(p[0] for p in parts), sum(p[1] for p in parts)


def hierarchical_time(colls: list[tuple[str, int]], nodes: int) -> dict[str, tuple[float, float]]:
    """``{"inner": .., "outer": ..}`` ``(latency, transfer)`` of ``colls`` (the flat program's)
    done hierarchically: gradients reduce-scattered in the node, their 1/8 shard all-reduced
    over the nodes; parameters gathered in the node only (HSDP)."""
    inner = [collective_time(k, b, PER_NODE, NVLINK) for k, b in colls]
    outer = [
        collective_time("all-reduce", b / PER_NODE, nodes, INFINIBAND)
        for k, b in colls
        if k in ("reduce-scatter", "all-reduce") and nodes > 1
    ]
    add = lambda ps: (sum(p[0] for p in ps), sum(p[1] for p in ps))  # noqa: E731
    return {"inner": add(inner), "outer": add(outer)}


def _ms(s: float) -> str:
    return f"{1e3 * s:.1f}"


# ---------------------------------------------------------------------- the measurement
def compile_gpt(quick: bool, wire: str, instances: int = 1) -> tuple[str, int, int, float]:
    """The 304M GPT's stage-1 step compiled for 8 compile-only H100s: ``(text, params,
    buckets, seconds)``; with ``instances`` > 1 as that many distributed-optimizer instances
    (``no_shard``) of consecutive devices."""
    from jaxdp import aot

    cfg = (
        GPTConfig(layers=2, width=128, heads=2, context=64, scan=True, attention="xla")
        if quick
        else GPTConfig(layers=24, width=1024, heads=16, context=1024, scan=True, attention="xla")
    )
    model = GPT(cfg)
    params = jax.eval_shape(
        lambda: model.init(jax.random.key(0), jnp.zeros((1, cfg.context), jnp.int32))["params"]
    )
    batch = {"tokens": jax.ShapeDtypeStruct((8, cfg.context + 1), jnp.int32)}
    ddp = DDPConfig(
        zero_stage=1,
        param_dtype="bfloat16",
        grad_reduce_in_fp32=wire == "fp32",
        num_distributed_optimizer_instances=instances,
    )

    def loss_fn(p: Any, b: Any) -> Any:
        return next_byte_loss(model, p, b)

    mesh: Any = aot.h100_mesh(8)
    if instances > 1:  # the engine groups the devices into instances
        mesh = list(mesh.devices.ravel())
    dp = DataParallel(loss_fn, optax.adamw(1e-3), ddp, mesh=mesh)
    t0 = time.perf_counter()
    text = aot.compile_step(dp, params, batch).as_text()
    psi = sum(math.prod(x.shape) for x in jax.tree.leaves(params))
    return text, psi, len(dp.layout.buckets), time.perf_counter() - t0


def stage_colls(
    grads: list[tuple[str, int]], gathers: list[tuple[str, int]], stage: str
) -> list[tuple[str, int]]:
    """A step's collectives: stages 1-2 reduce-scatter and gather once; stage 3 gathers twice."""
    return grads + gathers + (gathers if stage == "3" else [])


def synthetic(psi: int, wire_bytes: int, buckets: int) -> tuple[list[Any], list[Any]]:
    """``psi`` params in ``buckets`` equal buckets: gradient reduce-scatters on the wire dtype,
    bf16 parameter gathers."""
    return (
        [("reduce-scatter", psi * wire_bytes // buckets)] * buckets,
        [("all-gather", psi * 2 // buckets)] * buckets,
    )


def rows_for(model: str, per_wire: dict[str, tuple[list[Any], list[Any]]]) -> list[list[str]]:
    rows = []
    for wire, (grads, gathers) in per_wire.items():
        for stage in ("1/2", "3"):
            colls = stage_colls(grads, gathers, stage)
            gb = sum(b for _, b in colls) / 1e9
            for m in NODES:
                fl, ft = flat_time(colls, m)
                h = hierarchical_time(colls, m)
                hi, ho = h["inner"], h["outer"]
                hier = sum(hi) + sum(ho)
                rows.append(
                    [
                        model,
                        wire,
                        stage,
                        f"{m} x {PER_NODE}",
                        f"{gb:.2f}",
                        _ms(fl + ft),
                        f"{_ms(sum(hi))} + {_ms(sum(ho))}",
                        _ms(hier),
                        f"{(fl + ft) / hier:.1f}x",
                        f"{_ms(fl)} / {_ms(hi[0] + ho[0])}",
                    ]
                )
    return rows


def check_derivation(quick: bool, grads: list[Any], gathers: list[Any]) -> str:
    """The derivation of the hierarchical levels from the flat program, held against a
    compiled hierarchical program: the same GPT with 2 instances of 4 devices on the 8
    compile-only H100s (bf16 wire). Within the instance its reduce-scatters and gathers move
    the flat program's bytes; across instances its all-reduces move 1/4 of the gradient's."""
    text, _, _, seconds = compile_gpt(quick, "bf16", instances=2)
    levels = levels_of_program(text, 8, 4)
    inner_rs = sum(b for k, b in levels["inner"] if k == "reduce-scatter")
    inner_ag = sum(b for k, b in levels["inner"] if k == "all-gather")
    outer = sum(b for _, b in levels["outer"])
    want_rs, want_ag = sum(b for _, b in grads), sum(b for _, b in gathers)
    return (
        "Check of the derivation against a compiled hierarchical program (the same GPT, "
        "`num_distributed_optimizer_instances=2`: 2 instances of 4 on the 8 compile-only "
        f"H100s, bf16 wire, compiled in {seconds:.0f} s): within the instance "
        f"{inner_rs / 1e9:.3f} GB reduce-scattered (derived: {want_rs / 1e9:.3f}) and "
        f"{inner_ag / 1e9:.3f} GB gathered (derived: {want_ag / 1e9:.3f}); across instances "
        f"{outer / 1e9:.3f} GB all-reduced (derived, 1/4 of the gradient: "
        f"{want_rs / 4 / 1e9:.3f}); over all 8: {len(levels['flat'])} collectives."
    )


def result(quick: bool = False, plots: str | None = None) -> dict[str, Any]:
    del plots
    compiled: dict[str, tuple[list[Any], list[Any]]] = {}
    facts = []
    for wire in ("bf16",) if quick else WIRES:  # quick: one compile, the smoke test's
        text, psi, buckets, seconds = compile_gpt(quick, wire)
        levels = levels_of_program(text, 8, PER_NODE)
        flat = levels["flat"]
        grads = [(k, b) for k, b in flat if k in ("reduce-scatter", "all-reduce")]
        gathers = [(k, b) for k, b in flat if k == "all-gather"]
        compiled[wire] = (grads, gathers)
        ratio = sum(b for _, b in grads) / (psi * WIRES[wire])
        facts.append(
            f"{wire} wire: {len(grads)} gradient reduce-scatters "
            f"({sum(b for _, b in grads) / 1e9:.3f} GB = {ratio:.4f} x Ψ x {WIRES[wire]} B), "
            f"{len(gathers)} parameter all-gathers "
            f"({sum(b for _, b in gathers) / 1e9:.3f} GB) for {buckets} layout buckets; "
            f"compiled in {seconds:.0f} s"
        )
    check = check_derivation(quick, *compiled["bf16"])
    if quick:
        compiled["fp32"] = compiled["bf16"]
    big = {
        wire: synthetic(PARAMS_7B, nbytes, -(-PARAMS_7B // default_bucket_size(8)))
        for wire, nbytes in WIRES.items()
    }
    head = [
        "model",
        "wire",
        "stage",
        "nodes x GPUs",
        "GB per step",
        "flat ms",
        "hier. ms (NVLink + IB)",
        "hier. ms",
        "flat / hier.",
        "of it latency ms (flat / hier.)",
    ]
    rows = rows_for(f"{psi / 1e6:.0f}M GPT", compiled) + rows_for("7B GPT", big)
    table = H.table(head, rows, "lllrrrrrrr")
    model = "\n".join(
        [
            "The model (`jaxdp._src.topology.links`; docs/parallelism.md): a ring collective "
            "of a `B`-byte buffer over `n` ranks takes `(n - 1) alpha + (n - 1)/n * B/beta` for a "
            "reduce-scatter or all-gather and twice that for an all-reduce.",
            "",
            H.table(
                ["link", "beta per GPU, per direction", "alpha per ring step"],
                [
                    [NVLINK.name, f"{NVLINK.beta_bytes_per_s / 1e9:.0f} GB/s", "3.4 µs"],
                    [INFINIBAND.name, f"{INFINIBAND.beta_bytes_per_s / 1e9:.0f} GB/s", "9.6 µs"],
                ],
                "lrr",
            ),
            "",
            "- **flat**: one ring over all `8m` GPUs; every byte crosses the network at 50 GB/s "
            "per GPU; `m - 1` of the `8m - 1` steps pay the network's alpha, the others NVLink's.",
            "- **hierarchical** (one instance per node, `no_shard`): each gradient bucket "
            "reduce-scattered over the node's 8 GPUs (NVLink), its 1/8 shard all-reduced over "
            "the `m` nodes (IB, one ring per GPU and NIC); parameters gathered in the node.",
            "- stage 1/2: per step one gradient reduce-scatter and one parameter all-gather per "
            "bucket; stage 3: the gathers twice (forward, and again in the backward pass).",
            "- Not modelled: overlap with compute (these are the times of the collectives, not "
            "what is exposed), NCCL's tree and NVLS algorithms, congestion. Measured 8-GPU bus "
            f"bandwidths are below the link rate (310-360 GB/s), so the NVLink legs are lower "
            f"bounds. The bucket rule keeps each bucket's latency ≤ {LATENCY_SHARE:.0%} of its "
            "transfer.",
        ]
    )
    md = "\n\n".join(
        [
            "Bytes per step read from the stage-1 step of the 304M GPT "
            "(`configs/gpt_300m_gpu.yaml`, blocks scanned for a short compile) compiled for 8 "
            "compile-only H100s, default buckets (40M elements), bf16 params:",
            "\n".join(f"- {f}" for f in facts),
            "The 7B GPT (6.74B params) is not compiled: its bytes are Ψ x the wire dtype "
            f"(bf16 params gathered), in {-(-PARAMS_7B // default_bucket_size(8))} buckets of "
            "the default 40M elements, which is what the 304M program shows (ratio above). The "
            "hierarchical levels at 8 GPUs per node are derived from the flat program (inner "
            "reduce-scatter of the same bytes, outer all-reduce of 1/8): this machine has 8 "
            "compile-only devices, so a compiled hierarchical program has instances of 4.",
            check,
            model,
            table,
        ]
    )
    print(md)
    return {"markdown": md, "rows": rows}


if __name__ == "__main__":
    result(quick="--quick" in sys.argv)
