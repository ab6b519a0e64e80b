"""ZeRO-3 with a scanned layer stack, compiled for 8 compile-only H100s.

Skips without the ``gpu-aot`` extra, like test_zero3_aot.py. A bf16 MLP whose 8 hidden layers
are one ``[8, ...]`` stack run by ``lax.scan``: the stack's all-gathers sit in the scan loops
(forward, and the backward's re-gather), each moves one layer, the backward loop
reduce-scatters one layer per iteration, and the peak temporary memory is about one layer's
gathered params instead of the whole stack's (compared with ``scan_layers=False``).
"""

import jax
import jax.numpy as jnp
import optax
import pytest

from jaxdp import DataParallel, DDPConfig
from jaxdp.aot import compile_step, schedule_report

WIDTH, LAYERS, BATCH = 1024, 8, 64
LAYER = WIDTH * WIDTH + WIDTH  # elements of one layer of the stack (w and b)


@pytest.fixture(scope="module")
def mesh(h100):
    return h100  # conftest.py: 8 compile-only H100s, or a skip


def scan_mlp():
    f32 = jnp.float32
    params = {
        "inp": {"w": jax.ShapeDtypeStruct((WIDTH, WIDTH), f32)},
        "stack": {
            "w": jax.ShapeDtypeStruct((LAYERS, WIDTH, WIDTH), f32),
            "b": jax.ShapeDtypeStruct((LAYERS, WIDTH), f32),
        },
    }
    batch = {
        "x": jax.ShapeDtypeStruct((BATCH, WIDTH), f32),
        "y": jax.ShapeDtypeStruct((BATCH, WIDTH), f32),
    }

    def loss_fn(p, b):
        h = b["x"].astype(p["inp"]["w"].dtype) @ p["inp"]["w"]

        def layer(h, q):
            return jnp.tanh(h @ q["w"] + q["b"]), None

        h, _ = jax.lax.scan(layer, h, p["stack"])
        return jnp.mean((h.astype(jnp.float32) - b["y"]) ** 2)

    return loss_fn, params, batch


@pytest.fixture(scope="module", params=[1, 4], ids=["G1", "G4"])
def compiled(mesh, request):
    loss_fn, params, batch = scan_mlp()
    out = {}
    for scan in (True, False):
        cfg = DDPConfig(
            zero_stage=3, param_dtype="bfloat16", scan_layers=scan, num_microbatches=request.param
        )
        dp = DataParallel(loss_fn, optax.adamw(1e-3), cfg, mesh=mesh)
        exe = compile_step(dp, params, batch)
        out[scan] = (dp, schedule_report(exe), exe.memory_analysis())
    return request.param, out


def test_stack_gathered_per_layer_inside_the_loops(compiled):
    g, runs = compiled
    dp, report, _ = runs[True]
    assert [dp.layout.slots[i].path for i, _ in dp.layout.stacked] == ["stack/b", "stack/w"]
    ags = report.of_kind("all-gather")
    layers = [c for c in ags if c.elements >= LAYER]
    # per micro-batch (at G > 1 all in the micro-batch loop's body: stage 3 peels none out):
    # one all-gather in the forward layer loop and one in the backward layer loop, both
    # layers of the stack packed into one collective, each in its own loop body
    passes = 1
    in_loop = [c for c in layers if not c.entry]
    assert len(in_loop) == 2 * passes, report
    assert len({c.computation for c in in_loop}) == 2 * passes, report
    # At G = 1 jaxdp turns on XLA's pipelined all-gather: the loop prefetches the next layer,
    # and the first layer's gather is peeled out into the entry computation (one layer each).
    peeled = [c for c in layers if c.entry]
    assert len(peeled) <= (2 if g == 1 else 0), report
    assert all(c.elements < 1.01 * LAYER and c.dtype == "bf16" for c in layers), report
    # nothing anywhere gathers the stack (the unstacked "inp" bucket is smaller than a layer)
    assert all(c.elements < 2 * LAYER for c in ags), report
    # the gradient leaves the backward loop one layer at a time
    rs = [c for c in report.of_kind("reduce-scatter") if c.elements >= LAYER]
    assert len([c for c in rs if not c.entry]) == passes, report
    assert all(c.elements < 1.01 * LAYER for c in rs if not c.entry), report
    # G = 1: the pipeliner peels one backward iteration out of the loop; XLA's combiner may then
    # merge that layer's reduce-scatter with the small "inp" bucket's (both at the very end)
    peeled = [c for c in rs if c.entry]
    assert len(peeled) <= (1 if g == 1 else 0), report
    assert all(c.operands <= 2 and c.elements < 2.01 * LAYER for c in peeled), report
    whole, whole_report, _ = runs[False]
    assert not whole.layout.stacked
    # without scan_layers the stack's weight is gathered whole (per parameter, as every
    # interleaved stage-3 bucket, so "inp" and the biases may travel in other collectives)
    whole_ags = whole_report.of_kind("all-gather")
    assert any(c.elements >= LAYERS * WIDTH * WIDTH for c in whole_ags), whole_report


def test_peak_temp_is_about_one_layer(compiled):
    _, runs = compiled
    _, _, mem = runs[True]
    _, _, whole = runs[False]
    stack_bf16 = LAYERS * LAYER * 2
    # gathering the stack whole keeps all of it (bf16) alive; per layer saves most of that
    saved = whole.temp_size_in_bytes - mem.temp_size_in_bytes
    assert saved > 0.6 * stack_bf16, (mem.temp_size_in_bytes, whole.temp_size_in_bytes)
