"""The compiled ZeRO-3 / overlap_param_gather schedule on 8 compile-only H100s.

Skips without the ``gpu-aot`` extra, like test_aot.py. At stage 3 (a 4.2M-parameter bf16 MLP
in 5 buckets) every parameter is all-gathered twice (forward, and again in the backward instead
of being kept as a residual) and reduce-scattered once, in groups of at most one bucket; with
``overlap_param_gather`` stage 1's gathers (an 8-layer MLP in 4 buckets) move from after the
optimizer update into the forward pass. Stages 1-2 also gather and reduce-scatter per
parameter; XLA combines them into groups of at most one bucket.
"""

import itertools

import optax
import pytest
from _hlo import written_concatenations
from test_aot import MODES, build, grad_kind

from jaxdp import DataParallel, DDPConfig
from jaxdp.aot import (
    collective_roles,
    compile_step,
    example_mlp,
    gradient_collectives,
    schedule_report,
)


@pytest.fixture(scope="module")
def mesh(h100):
    return h100  # conftest.py: 8 compile-only H100s, or a skip


def compiled(mesh, stage, g=1, mode="bf16", **extra):
    dp, params, batch = build(mesh, stage, mode, g, **extra)
    report = schedule_report(compile_step(dp, params, batch))
    assert len(dp.layout.buckets) == 4
    return dp, report


def param_gathers(report, dp, entry=True):
    """The parameter all-gathers (one per bucket, or XLA's groups of per-parameter gathers) of
    one region, in schedule order."""
    roles = collective_roles(report, dp)
    return sorted(
        (
            c
            for c, r in zip(report.collectives, roles, strict=True)
            if c.entry == entry and r.startswith("param")
        ),
        key=lambda c: c.start_index,
    )


def build_big(mesh, mode, g):
    """Stage 3 on a 4.2M-parameter bf16 MLP (16 layers of 512) in 5 buckets: big enough that
    XLA's scheduler overlaps every collective (the model of bench/bench_memory_gpu.py)."""
    loss_fn, params, batch = example_mlp(16, 512, batch=256)
    cfg = DDPConfig(
        zero_stage=3,
        bucket_size=1_000_000,
        param_dtype="bfloat16",
        num_microbatches=g,
        **MODES[mode][0],
    )
    dp = DataParallel(loss_fn, optax.adamw(1e-3), cfg, mesh=mesh)
    report = schedule_report(compile_step(dp, params, batch))
    assert len(dp.layout.buckets) == 5
    return dp, report


def stage3_collectives(report, dp, entry=True):
    """(param gathers, gradient collectives) of one region, each in schedule order."""
    roles = collective_roles(report, dp)
    mine = [(c, r) for c, r in zip(report.collectives, roles, strict=True) if c.entry == entry]
    gathers = sorted((c for c, r in mine if r.startswith("param")), key=lambda c: c.start_index)
    grads = sorted((c for c, r in mine if r.startswith("grad")), key=lambda c: c.start_index)
    return gathers, grads


def split_passes(gathers, moved):
    """The gathers of the forward pass (the prefix that moves every parameter once) and those
    of the backward pass (the rest)."""
    total, k = 0, 0
    while total < moved:
        total += gathers[k].elements
        k += 1
    assert total == moved, [c.elements for c in gathers]
    return gathers[:k], gathers[k:]


@pytest.mark.parametrize("mode", list(MODES))
def test_stage3_gathers_twice_and_reduces_once(mesh, mode):
    """Every parameter is all-gathered twice (forward, and again in the backward instead of
    being kept as a residual) and its gradient reduced once. Per-parameter collectives
    (interleaved layout) are combined by XLA into groups of at most one bucket; fp32 wires and
    the all-to-all of reduce_scatter_with_fp32_accumulation stay one per bucket."""
    dp, report = build_big(mesh, mode, 1)
    lay, n = dp.layout, len(dp.layout.buckets)
    biggest = max(b.numel for b in lay.buckets)
    moved = sum(lay.dp_size * (s.end - s.start) for s in lay.slots)  # every parameter, padded
    kind, wire = grad_kind(3, mode), MODES[mode][1]
    gathers, grads = stage3_collectives(report, dp)
    assert all(c.is_async and c.dtype == "bf16" and c.elements <= biggest for c in gathers)
    forward, backward = split_passes(gathers, moved)
    # the backward pass re-gathers only what it reads: not the biases, and not the first
    # layer's weight (no gradient flows into the model's input)
    assert moved - biggest <= sum(c.elements for c in backward) < moved, report
    assert n - 1 <= len(forward) <= 2 * n and n - 1 <= len(backward) <= 2 * n, report
    assert all(c.kind == kind and c.dtype == wire for c in grads), report
    if mode != "bf16":  # fp32 wire or all-to-all: one per bucket, its padding included
        assert sorted(c.elements for c in grads) == sorted(b.numel for b in lay.buckets)
    else:
        assert sum(c.elements for c in grads) == moved and len(grads) <= 2 * n, report
    # the forward gathers come before the first gradient collective, the re-gathers after the
    # forward (in the backward pass); every forward gather but the first and every gradient
    # collective but the last has compute between its start and its done
    assert max(c.done_index for c in forward) < min(c.start_index for c in grads), report
    assert min(c.start_index for c in backward) > forward[-1].done_index, report
    for c in forward[1:]:
        assert c.compute_between >= 1 and c.gemms_between >= 1, report
    for c in grads[:-1]:
        assert c.compute_between >= 1 and c.backward_between >= 1, report
    assert not [c for c in report.collectives if not c.entry], report  # G = 1: no loop


def test_stage3_microbatches_gather_in_the_loop_too(mesh):
    dp, report = build_big(mesh, "bf16", 4)
    lay = dp.layout
    moved = sum(lay.dp_size * (s.end - s.start) for s in lay.slots)
    biggest = max(b.numel for b in lay.buckets)
    # every micro-batch runs in the scan (none is peeled out: each reduce-scatters inside its
    # own backward, so a peeled copy of the model would only double the program): the body
    # gathers every parameter twice and reduce-scatters its gradient into the sharded fp32
    # accumulator, and the rest of the step has no stage-3 collective
    gathers, grads = stage3_collectives(report, dp, entry=False)
    assert 2 * moved - biggest <= sum(c.elements for c in gathers) < 2 * moved, report
    assert sum(c.elements for c in grads) == moved, report
    assert stage3_collectives(report, dp, entry=True) == ([], []), report
    # In the loop body each pass re-gathers layer by layer: every gather but the first of its
    # pass overlaps a GEMM. (With XLA's default cost model the backward's gathers ran back to
    # back before its first GEMM, all of them alive at once: the analytical cost model that
    # jaxdp.xla_compiler_options sets for this config keeps them in order.)
    forward, backward = split_passes(gathers, moved)
    for one_pass in (forward, backward):
        assert all(c.gemms_between >= 1 for c in one_pass[1:]), report


@pytest.mark.parametrize("overlap", [False, True])
def test_overlap_param_gather_moves_the_gathers_into_the_forward(mesh, overlap):
    dp, report = compiled(mesh, 1, overlap_param_gather=overlap)
    psi = sum(b.numel for b in dp.layout.buckets)
    ags, grads = param_gathers(report, dp), gradient_collectives(report, dp)
    # every parameter gathered and reduce-scattered once (per parameter, grouped by XLA)
    assert sum(c.elements for c in ags) == psi == sum(c.elements for c in grads), report
    first_grad = min(c.start_index for c in grads)
    last_grad = max(c.done_index for c in grads)
    if overlap:  # before the backward pass: in the forward, once per step
        assert all(c.done_index < first_grad for c in ags), report
    else:  # after the reduce-scatters and the optimizer update
        assert all(c.start_index > last_grad for c in ags), report


@pytest.mark.parametrize("stage", [1, 2])
@pytest.mark.parametrize("g", [1, 4])
def test_end_of_step_gathers_keep_no_second_copy_of_the_params(mesh, stage, g):
    """Stages 1-2 gather the updated params per parameter, XLA combining them into groups of
    at most one bucket, each group done before the next starts, and no gathered copy of the
    params stays alive: a gathered parameter is the param itself (reshaped). With one gather
    per bucket XLA started every gather first and split them all at the end, temporaries of
    a full bf16 copy of the params (1,060,144 bytes here at G = 1; 796,976 with each bucket's
    gather ordered after the previous one's unpack). Per parameter, 80,960 with that ordering
    kept (until 2026-11-28) and 99,880 without it."""
    dp, params, batch = build(mesh, stage, "bf16", g)
    compiled = compile_step(dp, params, batch)
    ags = param_gathers(schedule_report(compiled.as_text()), dp)
    n, psi = len(dp.layout.buckets), sum(b.numel for b in dp.layout.buckets)
    biggest = max(b.numel for b in dp.layout.buckets)
    assert sum(c.elements for c in ags) == psi, ags  # every parameter once
    assert n <= len(ags) <= 2 * n and all(c.elements <= biggest for c in ags), ags
    assert all(b.start_index > a.done_index for a, b in itertools.pairwise(ags)), ags  # in turn
    acc = 0 if g == 1 else (4 * psi if stage == 1 else 4 * psi // 8)  # the fp32 accumulator
    assert compiled.memory_analysis().temp_size_in_bytes < 2 * psi + acc


@pytest.mark.parametrize("g", [1, 4])
@pytest.mark.parametrize("fp32_wire", [False, True], ids=["bf16-wire", "fp32-wire"])
def test_stage3_accumulates_each_parameter_on_its_own(h100, g, fp32_wire):
    """On a bf16 wire with per-parameter gathers, stage 3 reduces each gradient into an
    accumulator of its own (PerParamOps): no bucket's reduced pieces are concatenated (that
    concatenation, fused into every update, made each update a kernel of its own). With an
    fp32 wire the buckets are packed and reduced whole, which is how the check is checked."""
    from jaxdp import aot
    from jaxdp._src.comm.per_param import PerParamOps
    from jaxdp._src.strategy.plan import reduces_per_parameter

    loss_fn, params, batch = aot.example_mlp(layers=6, width=128, batch=64)
    cfg = DDPConfig(
        zero_stage=3,
        param_dtype="bfloat16",
        bucket_size=40_000,
        num_microbatches=g,
        grad_reduce_in_fp32=fp32_wire,
    )
    dp = DataParallel(loss_fn, optax.adam(1e-3), cfg, mesh=h100)
    text = aot.compile_step(dp, params, batch).as_text()
    per_bucket = max(len(b.slots) for b in dp.layout.buckets)
    assert per_bucket >= 4
    widest = max(len(c.operands) for c in written_concatenations(text))
    assert reduces_per_parameter(cfg, dp.layout) == (not fp32_wire)
    assert isinstance(dp.plan.strategy.ops, PerParamOps) == (not fp32_wire)
    if fp32_wire:
        assert widest >= per_bucket
    else:
        assert widest <= 2  # the metrics' small stacks, no bucket
