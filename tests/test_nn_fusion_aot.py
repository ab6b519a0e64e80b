"""What XLA emits for the fused weight-gradient GEMM, compiled for 8 compile-only H100s.

Skips without the ``gpu-aot`` extra. For a two-layer ``jaxdp.nn.Dense`` model with bf16 working
params and G = 4 micro-batches, every weight-gradient GEMM (the ``transpose(jvp(...))`` dot of
a kernel's shape) must read bf16 operands and write f32, and every instruction that consumes it
must be free of bf16 (the sum into the fp32 accumulator happens in one f32 fusion, no round
trip). The unfused program is checked as the contrast: its GEMM writes bf16 and the consumer
converts it back to f32.
"""

import re

import flax.linen as linen
import jax
import jax.numpy as jnp
import optax
import pytest

from jaxdp import DataParallel, DDPConfig, nn
from jaxdp.aot import compile_step

W, G = 256, 4


@pytest.fixture(scope="module")
def mesh(h100):
    return h100  # conftest.py: 8 compile-only H100s, or a skip


class MLP(linen.Module):
    @linen.compact
    def __call__(self, x):
        for i in range(2):
            x = jnp.tanh(nn.Dense(W, use_bias=False, dtype=jnp.bfloat16, name=f"l{i}")(x))
        return x


def compiled_text(mesh, stage, fuse):
    model = MLP()
    params = jax.eval_shape(lambda: model.init(jax.random.key(0), jnp.ones((1, W)))["params"])

    def loss_fn(p, b):
        return jnp.mean(model.apply({"params": p}, b["x"]).astype(jnp.float32) ** 2)

    batch = {"x": jax.ShapeDtypeStruct((8 * G * 64, W), jnp.bfloat16)}
    cfg = DDPConfig(
        zero_stage=stage,
        num_microbatches=G,
        param_dtype="bfloat16",
        grad_reduce_in_fp32=True,
        gradient_accumulation_fusion=fuse,
    )
    dp = DataParallel(loss_fn, optax.adamw(1e-3), cfg, mesh=mesh)
    return compile_step(dp, params, batch).as_text()


_HEADER = re.compile(r"^%(\S+) \((.*)\) -> (.+) \{$")  # a loop body returns a tuple
_INSTR = re.compile(r"^\s*(?:ROOT )?%(\S+) = (\S+?)(?:\{[^}]*\})? (\S+?)\((.*?)\)")


def computations(text):
    comps, name, body = {}, None, []
    for line in text.splitlines():
        m = _HEADER.match(line)
        if m:
            name, body = m.group(1), []
            comps[name] = (m.group(2), m.group(3), body)
        elif name and line.startswith("}"):
            name = None
        elif name:
            body.append(line)
    return comps


def wgrad_gemms(text):
    """(instruction line, called computation) of every weight-gradient GEMM fusion."""
    comps = computations(text)
    out = []
    for line in text.splitlines():
        m = re.search(r"%(\S+) = \S+ fusion\(.*calls=%([^,\s]+)", line)
        if not m or m.group(2) not in comps:
            continue
        params, result, body = comps[m.group(2)]
        root = next((b for b in body if "ROOT" in b), "")
        dot = next((b for b in body if " dot(" in b and "transpose(jvp(" in b), "")
        # the GEMM's root is the dot, or (accumulation in the epilogue) an add into the
        # accumulator that the fusion takes as a parameter
        if dot and (" dot(" in root or " add(" in root) and f"[{W},{W}]" in result:
            out.append((m.group(1), params, result, line, " add(" in root))
    return out


def consumers(text, name):
    comps = computations(text)
    found = []
    for line in text.splitlines():
        line = re.sub(r"/\*index=\d+\*/", "", line)  # operand lists carry /*index=N*/
        if re.search(rf"[(,] ?%{re.escape(name)}[,)]", line) and not line.lstrip().startswith(
            "ROOT %tuple"
        ):
            m = re.search(r"calls=%([^,\s]+)", line)
            called = "\n".join(comps[m.group(1)][2]) if m and m.group(1) in comps else ""
            found.append(line.split(" metadata=")[0] + "\n" + called)
    return found


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_fused_wgrad_gemm_writes_f32_into_accumulator(mesh, stage):
    text = compiled_text(mesh, stage, fuse=True)
    gemms = wgrad_gemms(text)
    # two layers, in the scanned micro-batches and (stages 0-1, which reduce after the loop)
    # in the peeled last one
    assert len(gemms) == (4 if stage < 2 else 2), [g[3][:120] for g in gemms]
    # Stages 0-1 accumulate per parameter (jaxdp._src.strategy.kernels.PerParameter):
    # in the scanned micro-batches the accumulation is the GEMM
    # fusion's own epilogue (acc + dot, the f32 accumulator an input of the fusion); the last
    # micro-batch's add goes into the bucket pack, and stage 2 reduce-scatters every
    # micro-batch's gradient instead of accumulating it.
    assert sum(g[4] for g in gemms) == (2 if stage < 2 else 0), [g[3][:160] for g in gemms]
    for name, params, result, _, epilogue in gemms:
        assert result.startswith("f32["), result
        assert params.count("bf16[") == 2, params  # both operands bf16
        assert params.count(f"f32[{W},{W}]") == (1 if epilogue else 0), params
        uses = consumers(text, name)
        assert uses or epilogue  # an epilogue GEMM may feed only the loop's carried tuple
        for use in uses:
            assert "bf16" not in use, use  # no bf16 round trip on the way to the accumulator
            assert "f32[" in use


def test_unfused_wgrad_gemm_rounds_to_bf16(mesh):
    text = compiled_text(mesh, 0, fuse=False)
    comps = computations(text)
    wgrads = [
        (n, c)
        for n, c in comps.items()
        if c[1].startswith(f"bf16[{W},{W}]") and "transpose(jvp(" in "\n".join(c[2])
    ]
    assert wgrads  # the GEMM's result is bf16
    assert any("convert(" in "\n".join(c[2]) and "add(" in "\n".join(c[2]) for c in comps.values())


def _loop_bodies(text):
    """(parameter list, result, instruction lines) of every while loop's body."""
    comps = computations(text)
    return [comps[n] for n in sorted(set(re.findall(r" while\(.*?body=%([^,\s]+)", text)))]


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_fused_loop_carries_no_fp32_copy_of_the_kernels(mesh, stage):
    """The fused kernels are lifted to fp32 in each micro-batch's own body, where XLA cancels
    the upcast against the layer's cast back (``jaxdp._src.core.fusion.fused_function``). Lifted
    once ahead of the loop, the loop carried an fp32 copy of every kernel and cast it back to
    bf16 each micro-batch: on an H200 (8 x 4096² ``Dense``, G = 8) 1.4-1.7 ms a step, and the
    fused step ran 0.992x-0.997x of the unfused one instead of 1.02x-1.09x."""
    text, unfused = compiled_text(mesh, stage, fuse=True), compiled_text(mesh, stage, fuse=False)
    comps = computations(text)
    bodies = _loop_bodies(text)
    assert len(bodies) == 1  # G = 4: the micro-batches run in one loop
    for line in bodies[0][2]:  # nothing kernel-shaped is cast from fp32 to bf16 in the loop
        m = re.search(rf"= bf16\[{W},{W}\]\S* fusion\(.*calls=%([^,\s]+)", line)
        if m and m.group(1) in comps:
            assert f"f32[{W},{W}]" not in comps[m.group(1)][0], line[:200]
    # the loop carries no more kernel-shaped fp32 arrays than the unfused one (accumulators)
    carried = [b[0][0].count(f"f32[{W},{W}]") for b in (bodies, _loop_bodies(unfused))]
    assert carried[0] <= carried[1], carried


class _Block(linen.Module):
    @linen.compact
    def __call__(self, x, _):
        return jnp.tanh(nn.Dense(W, use_bias=False, dtype=jnp.bfloat16, name="d")(x)), None


class ScannedMLP(linen.Module):
    @linen.compact
    def __call__(self, x):
        stack = linen.scan(
            _Block, variable_axes={"params": 0}, split_rngs={"params": True}, length=L
        )
        return stack(name="stack")(x, None)[0]


L = 3


def test_scanned_stacks_are_lifted_once_ahead_of_the_loop(mesh):
    """A layer in an ``nn.scan`` reads a slice of its stacked kernel, and its cast back to bf16
    sits in the model's own loop, where XLA cannot cancel it against the upcast: the stacks are
    lifted once, ahead of the micro-batch loop (``jaxdp._src.core.fusion.Lift.ahead``). Lifted in
    each micro-batch's body instead, they cost an fp32 copy a micro-batch (compiled for 8 H100s,
    an 8-layer scanned GPT of width 512, G = 4: peak 1.34 -> 1.44 GiB)."""
    model = ScannedMLP()
    x0 = jnp.ones((1, W), jnp.bfloat16)  # the scan's carry stays bf16
    params = jax.eval_shape(lambda: model.init(jax.random.key(0), x0)["params"])
    assert params["stack"]["d"]["kernel"].shape == (L, W, W)

    def loss_fn(p, b):
        return jnp.mean(model.apply({"params": p}, b["x"]).astype(jnp.float32) ** 2)

    cfg = DDPConfig(num_microbatches=G, param_dtype="bfloat16", gradient_accumulation_fusion=True)
    dp = DataParallel(loss_fn, optax.adamw(1e-3), cfg, mesh=mesh)
    batch = {"x": jax.ShapeDtypeStruct((8 * G * 64, W), jnp.bfloat16)}
    text = compile_step(dp, params, batch).as_text()
    comps = computations(text)
    upcast = rf"= f32\[{L},{W},{W}\]\S* fusion\(.*calls=%([^,\s]+)"
    bodies = _loop_bodies(text)
    assert bodies
    for _, _, lines in bodies:  # the stack is never upcast inside a loop
        for line in lines:
            m = re.search(upcast, line)
            if m and m.group(1) in comps:
                assert f"bf16[{L},{W},{W}]" not in comps[m.group(1)][0], line[:200]
    # ... but once, ahead of it
    assert any(
        f"bf16[{L},{W},{W}]" in comps[m.group(1)][0]
        for m in re.finditer(upcast, text)
        if m.group(1) in comps
    )
