"""Weights whose GEMM widths XLA pads (widths off 64 bf16 elements), and what jaxdp does.

* Which weights are off the grid, from their shapes, per working dtype; the report's line.
* The plan fences the backward pass at stages 0-2 when some weight is off the grid, and the
  fence changes no number: the same step, fenced and not, gives the same bits.
* Compiled for 8 compile-only H100s (a 4-layer MLP of width 724), the fence keeps XLA's padded
  weight copies out of the forward pass, and ``memory_report`` names the padding.
"""

import jax
import numpy as np
import optax
import pytest
from _models import make_batch, mlp_params, mse_loss

import jaxdp._src.strategy.plan as plan_module
from jaxdp import DataParallel, DDPConfig, aot
from jaxdp._src.platform.gemm_padding import grid, padding_note, unaligned
from jaxdp.aot._memory import padded_weights


def test_weights_off_the_grid():
    ws = [
        ("odd", (724, 724), "bfloat16"),
        ("half", (768, 720), "bfloat16"),
        ("even", (768, 768), "bfloat16"),
        ("bias", (724,), "bfloat16"),
        ("qkv", (768, 3, 12, 64), "bfloat16"),  # [d, 3 * heads * head_dim] is on the grid
        ("out", (12, 64, 768), "bfloat16"),  # [heads * head_dim, d] is
        ("f32", (736, 736), "float32"),  # fp32's grid is 32 elements
        ("f32odd", (724, 736), "float32"),
        ("ints", (7, 7), "int32"),
    ]
    got = {u.path: u for u in unaligned(ws)}
    assert sorted(got) == ["f32odd", "half", "odd"]
    assert got["odd"].widths == (724,) and got["half"].widths == (720,)
    # the larger of the two padded copies: [768, 724] (either way for a square weight)
    assert got["odd"].padded_bytes == 768 * 724 * 2
    assert got["f32odd"].padded_bytes == 736 * 736 * 4
    assert (grid("bfloat16"), grid("float16"), grid("float32")) == (64, 64, 32)


def test_padding_note():
    ws = unaligned([(f"l{i}/w", (720, 724), "bfloat16") for i in range(8)])
    psi = 8 * 720 * 724
    note = padding_note(ws, psi, padded=8)
    assert note.startswith("widths 720, 724 are padded by XLA: +2.1 B/param under plain jit")
    assert note.endswith("multiples of 64 avoid it")
    assert "8 of 8 weights" in note
    assert "padded none" in padding_note(ws, psi, padded=0)
    assert padding_note((), psi) == ""


def test_padded_weights_read_from_the_program():
    ws = unaligned([("a", (724, 724), "bfloat16"), ("b", (700, 720), "bfloat16")])
    text = (
        "%p1 = bf16[768,724]{1,0} pad(%x, %z), padding=0_44x0_0\n"
        "%p2 = bf16[32,768]{1,0} pad(%y, %z), padding=0_0x0_44\n"  # an activation
        "%p3 = bf16[720,768]{1,0} pad(%w, %z), padding=0_48x0_0\n"  # b's transpose, widened
    )
    assert padded_weights(text, ws) == 2
    assert padded_weights(text.replace("720,768", "640,768"), ws) == 1


def _engine(stage, **kw):
    cfg = DDPConfig(zero_stage=stage, **kw)
    return DataParallel(mse_loss, optax.adam(1e-2), cfg)


@pytest.mark.parametrize(
    "stage, sizes, fenced",
    [
        (1, (6, 16, 16, 4), True),
        (2, (64, 128, 64, 64), False),
        (3, (6, 16, 16, 4), False),  # stage 3 gathers the params again in the backward
    ],
)
def test_plan_fences_stages_0_2_with_weights_off_the_grid(stage, sizes, fenced):
    dp = _engine(stage)
    jax.eval_shape(dp.init, mlp_params(sizes=sizes))
    assert not dp.plan.strategy.spec.fence_backward  # XLA:CPU: no split-K padding to avoid
    assert plan_module.fences_backward(dp.config, dp.layout, "gpu") is fenced


@pytest.mark.parametrize("stage, g", [(0, 1), (2, 4)])
def test_fence_changes_no_number(monkeypatch, stage, g):
    params, batch = mlp_params(), make_batch(32)

    def run():
        dp = _engine(stage, num_microbatches=g, param_dtype="bfloat16")
        state = dp.init(params)
        state, metrics = dp.step(state, dp.shard_batch(batch))
        return dp, jax.device_get((dp.params(state), metrics["loss"], metrics["grad_norm"]))

    monkeypatch.setattr(plan_module, "fences_backward", lambda *a: True)
    fenced_dp, fenced = run()
    monkeypatch.setattr(plan_module, "fences_backward", lambda *a: False)
    plain_dp, plain = run()
    assert fenced_dp.plan.strategy.spec.fence_backward
    assert not plain_dp.plan.strategy.spec.fence_backward
    for a, b in zip(jax.tree.leaves(fenced), jax.tree.leaves(plain), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_fence_keeps_padded_copies_out_of_the_forward(h100, monkeypatch):
    loss_fn, params, batch = aot.example_mlp(layers=4, width=724, batch=256)
    psi = sum(x.size for x in jax.tree.leaves(params))

    def compile_stage1():
        dp = DataParallel(
            loss_fn,
            optax.adam(1e-3),
            DDPConfig(zero_stage=1, param_dtype="bfloat16", bucket_size=1_000_000),
            mesh=h100,
        )
        compiled = aot.compile_step(dp, params, batch)
        return dp, compiled, compiled.memory_analysis().temp_size_in_bytes / psi

    dp, compiled, fenced = compile_stage1()
    report = aot.memory_report(compiled, dp)
    assert report.padded == 4 and len(report.unaligned) == 4
    assert report.padding.startswith("widths 724 are padded by XLA: +2.")
    assert str(report).splitlines()[1] == report.padding
    monkeypatch.setattr(plan_module, "fences_backward", lambda *a: False)
    _, _, plain = compile_stage1()
    # three of the four padded [724, 768] copies (1.5 B/param) were alive across the forward
    assert plain - fenced > 1.0, (plain, fenced)
