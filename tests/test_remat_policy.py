"""DDPConfig.remat_policy: what stage 3's jax.checkpoint saves, and that it changes no numbers.

* Every policy yields the gradients of ``"everything"`` (jaxdp's policy before the field),
  bit for bit, on the small transformer, unrolled and ``nn.scan``-stacked (whose scan bodies
  take the same policy), with bf16 working params and micro-batches.
* No policy saves a gathered param (named ``GATHERED``) or a layout primitive's output; the
  policies differ where documented (batched dots, cuDNN fused attention).
* Compiled for 8 compile-only H100s (a small GPT), every policy gathers the params again in
  the backward pass, and the default's temporaries are at most those of ``"everything"``.
"""

import collections
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _models import capture_grads
from _transformer import (
    scan_transformer_loss,
    scan_transformer_params,
    transformer_batches,
    transformer_loss,
    transformer_params,
)
from jax.ad_checkpoint import checkpoint_name
from test_zero3_aot import stage3_collectives

import jaxdp
from jaxdp import DataParallel, DDPConfig, aot
from jaxdp._src.config.config import REMAT_POLICIES
from jaxdp._src.zero3.remat import (
    _LAYOUT_PRIMITIVES,
    DOT_OPERAND,
    GATHERED,
    SCAN_CARRY,
    remat_policy_for,
)
from jaxdp.models import GPT, GPTConfig, next_byte_loss

MODELS = {
    "transformer": (transformer_loss, transformer_params),
    "scan_transformer": (scan_transformer_loss, scan_transformer_params),
}


def stage3_engine(loss_fn, policy, bucket_size):
    """Stage 3 with bf16 params, G = 2 and ``policy``, whose optimizer state after a step is
    that step's reduced gradient (``capture_grads``)."""
    cfg = DDPConfig(
        zero_stage=3,
        num_microbatches=2,
        param_dtype="bfloat16",
        bucket_size=bucket_size,
        remat_policy=policy,
    )
    return DataParallel(loss_fn, capture_grads(), cfg, mesh=jaxdp.make_mesh())


def exact_step(dp, state, batch):
    """One step of ``dp`` compiled without XLA:CPU's excess-precision rewrite:
    ``(reduced gradient, loss)``.

    XLA:CPU may keep a bf16 intermediate in f32 inside a fusion ("excess precision"), and what
    a policy saves decides what is fused: such roundings then differ by a bf16 ulp in a few
    local gradients (seen on the scanned transformer). Without that rewrite the programs
    compute the same numbers."""
    step = dp.step.lower(state, batch).compile(
        compiler_options={"xla_allow_excess_precision": False}
    )
    state, metrics = step(state, batch)
    return jax.device_get(state.opt_state), float(metrics["loss"])


@functools.cache
def _grads(model, policy):
    """The reduced gradient of one stage-3 step (bf16 params, G = 2, several buckets)."""
    loss_fn, make_params = MODELS[model]
    dp = stage3_engine(loss_fn, policy, bucket_size=300)
    batch = transformer_batches(32, 1)[0]
    state = dp.init(make_params(), example_batch=batch)
    assert len(dp.layout.buckets) > 3
    assert bool(dp.layout.stacked) == (model == "scan_transformer")
    return exact_step(dp, state, dp.shard_batch(batch))


@pytest.mark.parametrize("policy", [p for p in REMAT_POLICIES if p != "everything"])
@pytest.mark.parametrize("model", list(MODELS))
def test_every_policy_gives_the_same_gradients(model, policy):
    """Rematerialisation recomputes the same ops on the same inputs: the gradients are those
    of saving everything, bit for bit (with XLA:CPU's excess-precision rewrite off, see
    _grads)."""
    grads, loss = _grads(model, policy)
    want, want_loss = _grads(model, "everything")
    assert loss == want_loss
    for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(want), strict=True):
        np.testing.assert_array_equal(a, b)


def _saved(policy, fn, *args):
    """``[(primitive name, saved?)]`` for the equations of ``fn``'s jaxpr, in order."""
    jaxpr = jax.make_jaxpr(fn)(*args).jaxpr
    return [
        (e.primitive.name, bool(policy(e.primitive, *[v.aval for v in e.invars], **e.params)))
        for e in jaxpr.eqns
    ]


def test_policies_save_what_they_document():
    def layer(w, x):
        w = checkpoint_name(w, GATHERED)
        w = jnp.transpose(w.astype(jnp.bfloat16).reshape(8, 8))  # layout of the gathered param
        h = jnp.tanh(x @ w)  # a GEMM (no batch dims)
        s = jnp.einsum("bqd,bkd->bqk", h, h)  # a batched dot larger than both operands (scores)
        return jnp.einsum("bqk,bkd->bqd", s, h)  # one no larger than an operand (context)

    args = (jnp.ones((64,), jnp.float32), jnp.ones((2, 16, 8), jnp.bfloat16))
    saved = {p: _saved(remat_policy_for(p), layer, *args) for p in REMAT_POLICIES}
    names = [n for n, _ in saved["gemm"]]
    assert names == [
        "name", "convert_element_type", "reshape", "transpose", "dot_general", "tanh",
        "dot_general", "dot_general",
    ]  # fmt: skip
    for p, s in saved.items():  # never the gathered param or what layout primitives derive
        assert not any(v for _, v in s[:4]), (p, s)
    flags = {p: [v for _, v in s[4:]] for p, s in saved.items()}  # GEMM, tanh, scores, context
    assert flags == {
        "gemm": [True, False, False, True],
        "dots": [True, False, True, True],
        "everything": [True, True, True, True],
        "nothing": [False, False, False, False],
    }
    # the layer inputs of gathered scans: kept unless everything is recomputed (else the
    # backward pass would run the forward loop again, gathers included)
    # and the operands of batched dots stage 3 names (jaxdp._src.zero3.dot_operands)
    for name in (SCAN_CARRY, DOT_OPERAND):
        eqn = jax.make_jaxpr(lambda h, n=name: checkpoint_name(h, n))(args[1]).jaxpr.eqns[0]
        for p in REMAT_POLICIES:
            policy = remat_policy_for(p)
            assert policy(eqn.primitive, eqn.invars[0].aval, **eqn.params) == (p != "nothing")
    # every primitive "everything" treats as layout is refused by every policy
    for name in _LAYOUT_PRIMITIVES:
        prim = jax.extend.core.Primitive(name)
        for p in REMAT_POLICIES:
            assert not remat_policy_for(p)(prim), (p, name)


def test_gemm_and_dots_save_cudnn_fused_attention():
    """jax.nn.dot_product_attention(implementation="cudnn") reaches a policy as these
    primitives (its custom_vjp's forward rule; checked by tracing with cuDNN's version checks
    patched). Its output and softmax statistics are as cheap to keep as a GEMM output and
    costly to recompute (on one H100, the 303M GPT's stage-3 step took 1.070x bare with
    attention recomputed, 1.040x with it saved), so the default keeps them."""
    for name in ("dot_product_attention_fwd_wrapper", "dot_product_attention_fp8_fwd_wrapper"):
        prim = jax.extend.core.Primitive(name)
        saved = {p: remat_policy_for(p)(prim) for p in REMAT_POLICIES}
        assert saved == {"gemm": True, "dots": True, "everything": True, "nothing": False}


# ---------------------------------------------------------------- 8 compile-only H100s
@functools.cache
def _compiled(mesh, policy):
    cfg = GPTConfig(layers=2, width=256, heads=4, context=128)
    model = GPT(cfg)
    params = jax.eval_shape(
        lambda: model.init(jax.random.key(0), jnp.zeros((1, cfg.context), jnp.int32))["params"]
    )
    batch = {"tokens": jax.ShapeDtypeStruct((8 * 8, cfg.context + 1), jnp.int32)}
    dcfg = DDPConfig(zero_stage=3, param_dtype="bfloat16", bucket_size=400_000, remat_policy=policy)
    dp = DataParallel(lambda p, b: next_byte_loss(model, p, b), optax.adamw(1e-3), dcfg, mesh=mesh)
    compiled = aot.compile_step(dp, params, batch)
    return dp, aot.schedule_report(compiled), compiled.memory_analysis(), compiled.as_text()


def _batched_gemms(text):
    """How many GEMM kernels of the compiled program produce each batched (rank-3) shape,
    dims sorted (XLA may transpose the layout)."""
    kinds = ('"kind":"__triton_nested_gemm_fusion"', '"kind":"__triton_gemm"', "__cublas")
    counts = collections.Counter()
    for line in text.splitlines():
        if (" fusion(" in line or "custom-call(" in line) and any(k in line for k in kinds):
            m = re.search(r"= \(?[a-z0-9]+\[([0-9,]+)\]", line)
            dims = tuple(sorted(int(d) for d in m.group(1).split(","))) if m else ()
            if len(dims) == 3:
                counts[dims] += 1
    return counts


@pytest.mark.parametrize("policy", REMAT_POLICIES)
def test_every_policy_gathers_again_in_the_backward(h100, policy):
    dp, report, _, _ = _compiled(h100, policy)
    lay = dp.layout
    moved = sum(lay.dp_size * (s.end - s.start) for s in lay.slots)
    biggest = max(b.numel for b in lay.buckets)
    gathers, _ = stage3_collectives(report, dp)
    # each param gathered in the forward pass and what the backward pass reads gathered again
    # (all of it where the embedding lookup is recomputed, "gemm" and "nothing"); counted over
    # the whole step, as XLA may schedule a forward gather (the head's bias) after a re-gather
    assert 2 * moved - biggest <= sum(c.elements for c in gathers) <= 2 * moved, report


@pytest.mark.parametrize("policy", REMAT_POLICIES)
def test_only_the_attention_scores_gemm_is_recomputed(h100, policy):
    """XLA's attention in the 2-layer GPT (8 sequences x 4 heads a device, context 128, head
    dim 64): each layer's forward runs one scores GEMM ([32, 128, 128]) and one context GEMM
    ([32, 128, 64]), its backward one more of the first shape and three more of the second.
    ``"gemm"`` recomputes the scores (their fp32 softmax is not kept: quadratic in the
    context) but keeps the context, which the output projection's weight gradient reads;
    ``"dots"`` and ``"everything"`` recompute neither, ``"nothing"`` both."""
    counts = _batched_gemms(_compiled(h100, policy)[3])
    scores, context = counts[(32, 128, 128)], counts[(32, 64, 128)]
    layers = 2
    assert (scores, context) == {
        "gemm": (3 * layers, 4 * layers),
        "dots": (2 * layers, 4 * layers),
        "everything": (2 * layers, 4 * layers),
        "nothing": (3 * layers, 5 * layers),
    }[policy], counts


def test_default_policy_needs_no_more_temp_memory_than_everything(h100):
    assert DDPConfig().remat_policy == "gemm"
    gemm = _compiled(h100, "gemm")[2].temp_size_in_bytes
    everything = _compiled(h100, "everything")[2].temp_size_in_bytes
    assert gemm <= everything, (gemm, everything)


def _remats(dp, state, batch):
    """How many ``jax.checkpoint`` regions the jaxpr of ``dp``'s step holds."""
    jaxpr = jax.make_jaxpr(dp.step._jitted)(state, batch).jaxpr

    def walk(j):
        for e in j.eqns:
            yield e.primitive.name
            for v in e.params.values():
                for sub in v if isinstance(v, (tuple, list)) else (v,):
                    inner = getattr(sub, "jaxpr", sub)
                    if isinstance(inner, jax.extend.core.Jaxpr):
                        yield from walk(inner)

    return sum(name in ("checkpoint", "remat2") for name in walk(jaxpr))


@pytest.mark.parametrize("model", list(MODELS))
def test_one_rank_does_not_rematerialise(model):
    """With one rank stage 3's gathers are identities, so it wraps nothing in
    ``jax.checkpoint`` (``rematerialises``) and its steps are stage 2's, bit for bit: params
    and losses over 3 steps (bf16 params, G = 2, AdamW), and the gradient norms of the
    unrolled model (the scanned model's differed from stage 2's in the last bit before this
    rule too, with the same params). Two ranks still rematerialise."""
    loss_fn, make_params = MODELS[model]
    batches = transformer_batches(8, 3)
    runs = {}
    for stage in (2, 3):
        cfg = DDPConfig(zero_stage=stage, num_microbatches=2, param_dtype="bfloat16")
        dp = DataParallel(loss_fn, optax.adamw(1e-3), cfg, mesh=jaxdp.make_mesh(jax.devices()[:1]))
        state = dp.init(make_params(), example_batch=batches[0])
        if stage == 3:
            assert _remats(dp, state, dp.shard_batch(batches[0])) == 0
        metrics = []
        for b in batches:
            state, m = dp.step(state, b)
            metrics.append((float(m["loss"]), float(m["grad_norm"])))
        runs[stage] = jax.device_get(dp.params(state)), metrics
    losses = {s: [m[0] for m in runs[s][1]] for s in runs}
    assert losses[3] == losses[2]
    if model == "transformer":  # the stacks' norm: a last-bit difference, as it had before
        assert runs[3][1] == runs[2][1]
    for a, b in zip(*(jax.tree.leaves(runs[s][0]) for s in (3, 2)), strict=True):
        np.testing.assert_array_equal(a, b)
    cfg = DDPConfig(zero_stage=3, param_dtype="bfloat16")
    two = DataParallel(loss_fn, optax.adamw(1e-3), cfg, mesh=jaxdp.make_mesh(jax.devices()[:2]))
    state = two.init(make_params(), example_batch=batches[0])
    assert _remats(two, state, two.shard_batch(batches[0])) > 0
