"""Stage 3 names the operands of batched dots (XLA's attention) so its remat policy keeps them.

* ``name_batched_dot_operands`` names exactly the operands of batched ``dot_general`` s that are
  not (layout derivatives of) params, once per value, through ``jit`` calls and ``scan``
  bodies; values and gradients are unchanged; a function without batched dots is called as it
  is; a rewrite that fails warns and falls back.
* Under ``jax.checkpoint`` with the ``"gemm"`` policy the softmax probabilities and the other
  operands are saved residuals.
* The engine at stage 3 names them for ``"gemm"`` / ``"dots"`` only, on the unrolled and the
  scanned transformer, and its steps match ``"everything"`` (``test_remat_policy.py`` checks
  that bit for bit).
"""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _transformer import (
    scan_transformer_loss,
    scan_transformer_params,
    transformer_batches,
    transformer_loss,
    transformer_params,
)
from jax.ad_checkpoint import checkpoint_name
from test_remat_policy import exact_step, stage3_engine

import jaxdp
from jaxdp import DataParallel, DDPConfig
from jaxdp._src.zero3 import dot_operands as _dot_operands
from jaxdp._src.zero3.dot_operands import name_batched_dot_operands
from jaxdp._src.zero3.remat import DOT_OPERAND, GATHERED, gemm_policy, remat_policy_for


def _eqns(jaxpr):
    """Every equation of ``jaxpr`` and of the jaxprs in its equations' params."""
    for e in jaxpr.eqns:
        yield e
        for v in e.params.values():
            for sub in v if isinstance(v, (tuple, list)) else (v,):
                inner = getattr(sub, "jaxpr", sub)
                if isinstance(inner, jax.extend.core.Jaxpr):
                    yield from _eqns(inner)


def _step_names(dp, state, batch):
    """The ``checkpoint_name`` s in the jaxpr of ``dp``'s step."""
    jaxpr = jax.make_jaxpr(dp.step._jitted)(state, batch).jaxpr
    return [e.params["name"] for e in _eqns(jaxpr) if e.primitive.name == "name"]


def _names(fn, *args):
    jaxpr = jax.make_jaxpr(fn)(*args).jaxpr
    return [e.params["name"] for e in _eqns(jaxpr) if e.primitive.name == "name"]


def attention(params, x):
    """One head-split attention layer: GEMMs, XLA's attention, a per-head batched weight."""
    q, k, v = (x @ params[n] for n in ("q", "k", "v"))  # [b, t, d]: GEMMs
    split = lambda a: a.reshape(a.shape[0], a.shape[1], 2, -1)  # noqa: E731
    s = jnp.einsum("bqhd,bkhd->bhqk", split(q), split(k))
    p = jax.nn.softmax(s.astype(jnp.float32), axis=-1).astype(x.dtype)
    o = jnp.einsum("bhqk,bkhd->bqhd", p, split(v)).reshape(q.shape)
    # a batched dot with a param operand (per-head weights): only the activation is named
    w = checkpoint_name(params["heads"], GATHERED).astype(x.dtype)
    return jnp.sum(jnp.einsum("bqhd,hde->bqhe", split(o), w) ** 2)


def _args(dtype=jnp.float32):
    r = np.random.default_rng(0)
    params = {n: jnp.asarray(r.standard_normal((8, 8)) * 0.3, dtype) for n in "qkv"}
    params["heads"] = jnp.asarray(r.standard_normal((2, 4, 3)) * 0.3, jnp.float32)
    return params, jnp.asarray(r.standard_normal((2, 5, 8)), dtype)


def test_names_the_activation_operands_of_batched_dots_once():
    params, x = _args()
    # q, k (scores), p, v (context) and the heads' input o; not the per-head weight
    names = _names(name_batched_dot_operands(attention), params, x)
    assert sorted(names) == sorted([GATHERED] + [DOT_OPERAND] * 5), names

    # a value two batched dots read is named once
    def twice(p, a):
        return jnp.einsum("bqd,bkd->bqk", a, a).sum() + jnp.einsum("bqd,bqd->bq", a, a).sum()

    assert _names(name_batched_dot_operands(twice), params, x) == [DOT_OPERAND]


def test_same_values_and_gradients():
    for dtype in (jnp.float32, jnp.bfloat16):
        params, x = _args(dtype)
        named = name_batched_dot_operands(attention)
        assert named(params, x) == attention(params, x)
        for a, b in zip(
            jax.tree.leaves(jax.grad(named)(params, x)),
            jax.tree.leaves(jax.grad(attention)(params, x)),
            strict=True,
        ):
            np.testing.assert_array_equal(a, b)


def test_through_jit_and_scan():
    params, x = _args()

    def layers(p, a):
        def body(h, w):
            s = jnp.einsum("bqd,bkd->bqk", h @ w, h)
            return jax.nn.softmax(s) @ h, None

        h, _ = jax.lax.scan(body, a, jnp.stack([p["q"], p["k"]]))
        return jax.jit(attention)(p, h)

    named = name_batched_dot_operands(layers)
    names = _names(named, params, x)
    assert names.count(DOT_OPERAND) == 3 + 5, names  # the scan body's three, attention's five
    # compared jitted: run op by op, the inlined jit and the original differ in rounding
    assert jax.jit(named)(params, x) == jax.jit(layers)(params, x)
    np.testing.assert_array_equal(
        jax.jit(jax.grad(named))(params, x)["q"], jax.jit(jax.grad(layers))(params, x)["q"]
    )


def test_without_batched_dots_the_function_is_called_as_it_is():
    params, x = _args()

    def dense(p, a):
        return jnp.sum(jnp.tanh(a @ p["q"]) @ p["k"])

    named = name_batched_dot_operands(dense)
    assert _names(named, params, x) == []
    assert str(jax.make_jaxpr(named)(params, x)) == str(jax.make_jaxpr(dense)(params, x))


def test_a_failed_rewrite_warns_and_falls_back(monkeypatch):
    params, x = _args()

    def broken(*args, **kw):
        raise NotImplementedError("no rule")

    monkeypatch.setattr(_dot_operands, "_eval", broken)
    with pytest.warns(RuntimeWarning, match="could not name the operands"):
        out = name_batched_dot_operands(attention)(params, x)
    assert out == attention(params, x)


def test_gemm_keeps_the_softmax_probabilities():
    """With the operands named, ``"gemm"`` saves XLA's attention's probabilities
    (``[batch, heads, q, k]``) and the queries, keys, values and context it reads, in place of
    the projections' outputs they are reshaped from; without, it saves none of them."""
    saved_residuals = pytest.importorskip("jax._src.ad_checkpoint").saved_residuals
    params, x = _args()

    def saved(fn):
        res = saved_residuals(jax.checkpoint(fn, policy=gemm_policy), params, x)
        return sorted(tuple(a.shape) for a, why in res if DOT_OPERAND in why)

    assert saved(attention) == []
    assert saved(name_batched_dot_operands(attention)) == [(2, 2, 5, 5)] + [(2, 5, 2, 4)] * 4


@pytest.mark.parametrize(
    "loss_fn, make_params",
    [(transformer_loss, transformer_params), (scan_transformer_loss, scan_transformer_params)],
    ids=["unrolled", "scan"],
)
@pytest.mark.parametrize("policy", ["gemm", "dots", "everything", "nothing"])
def test_stage3_names_them_for_gemm_and_dots(loss_fn, make_params, policy):
    cfg = DDPConfig(zero_stage=3, bucket_size=300, remat_policy=policy)
    dp = DataParallel(loss_fn, optax.sgd(0.1), cfg, mesh=jaxdp.make_mesh())
    batch = transformer_batches(32, 1)[0]
    state = dp.init(make_params(), example_batch=batch)
    batch = dp.shard_batch(batch)
    names = _step_names(dp, state, batch)
    want = policy in ("gemm", "dots")
    assert (DOT_OPERAND in names) == want, (policy, set(names))
    assert remat_policy_for(cfg.remat_policy)  # the policy exists for every value
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # no fallback on these models
        dp.step(state, batch)


@pytest.mark.parametrize("scan", [False, True], ids=["unrolled", "nn.scan"])
def test_stage3_gpt_with_xla_attention_and_dropout_matches_everything(scan):
    """jaxdp.models.GPT with XLA's attention (flax modules, dropout drawn from the step's rng,
    bf16 working params, G = 2): ``"gemm"`` names the attention's operands and its gradients
    are those of ``"everything"`` bit for bit (XLA:CPU's excess-precision rewrite off, as in
    test_remat_policy), with no fallback warning."""
    from jaxdp.models import GPT, GPTConfig, next_byte_loss

    cfg = GPTConfig(
        layers=2, width=32, heads=2, context=16, attention="xla", dropout=0.1, scan=scan
    )
    model = GPT(cfg)
    params = model.init(jax.random.key(0), jnp.zeros((1, cfg.context), jnp.int32))["params"]
    tokens = np.random.default_rng(1).integers(0, 256, (16, cfg.context + 1), dtype=np.int32)

    def loss_fn(p, b, rng=None):
        return next_byte_loss(model, p, b, rng)

    out = {}
    for policy in ("gemm", "everything"):
        dp = stage3_engine(loss_fn, policy, bucket_size=2_000)
        batch = {"tokens": tokens}
        state = dp.init(params, rng=jax.random.key(2), example_batch=batch)
        batch = dp.shard_batch(batch)
        assert (DOT_OPERAND in _step_names(dp, state, batch)) == (policy == "gemm")
        with warnings.catch_warnings():
            warnings.simplefilter("error", RuntimeWarning)
            out[policy] = exact_step(dp, state, batch)
    assert out["gemm"][1] == out["everything"][1]
    for a, b in zip(
        jax.tree.leaves(out["gemm"][0]), jax.tree.leaves(out["everything"][0]), strict=True
    ):
        np.testing.assert_array_equal(a, b)
