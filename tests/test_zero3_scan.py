"""ZeRO-3 with scanned layer stacks: one layer gathered per scan iteration.

Numerics against the single-device reference use the tolerances of tests/test_zero3.py. The
per-layer gather is the same collective as a bucket's, on a per-layer bucket, so the result must
also equal the same scanned model with ``scan_layers=False`` (the stacks gathered whole, with
their bucket) to fp32 rounding: XLA:CPU's excess-precision rewrites (it may skip a bf16 rounding of
a local gradient fused with its fp32 cast) differ between the two programs by 1 fp32 ulp in a few
elements; often the results are bitwise equal.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _models import make_batch, scan_mlp_loss, scan_mlp_params
from _transformer import LAYERS, make_scan_transformer_loss, scan_transformer_params
from test_zero3 import _check_parity, _run, check_restores_exactly

import jaxdp
from jaxdp import DataParallel, DDPConfig

N_STACKED = {"scan_transformer": 12, "scan_mlp": 2}


@pytest.mark.parametrize("mode", ["bf16", "fp32-wire", "fp32-accum"])
@pytest.mark.parametrize("g", [1, 4])
@pytest.mark.parametrize("model", ["scan_transformer", "scan_mlp"])
def test_stage3_scan_parity(model, g, mode):
    dp, state, norms = _run(model, 3, g, mode, "several")
    assert len(dp.layout.stacked) == N_STACKED[model]
    assert all(ax == 0 for _, ax in dp.layout.stacked)
    _check_parity(model, mode, dp, state, norms)


@pytest.mark.parametrize(
    ("model", "g", "mode"),
    [("scan_mlp", 4, "bf16"), ("scan_transformer", 4, "fp32-accum"), ("scan_mlp", 1, "fp32-wire")],
)
def test_scan_equals_whole_stack_gather(model, g, mode):
    """Per-layer gathers and reduce-scatters: the numbers of gathering the stack whole."""
    dp, s_scan, n_scan = _run(model, 3, g, mode, "several")
    whole, s_whole, n_whole = _run(model, 3, g, mode, "several", scan_layers=False)
    assert dp.layout.stacked and not whole.layout.stacked
    np.testing.assert_allclose(n_scan, n_whole, rtol=1e-6)  # squares summed in another order
    for a, b in zip(
        jax.tree.leaves(dp.params(s_scan)), jax.tree.leaves(whole.params(s_whole)), strict=True
    ):
        np.testing.assert_allclose(a, b, rtol=2e-6, atol=1e-8)


def test_scanned_equals_unrolled_transformer():
    """The nn.scan transformer at stage 3 (per layer) against the unrolled one (per bucket)."""
    dp, s_scan, n_scan = _run("scan_transformer", 3, 1, "fp32", "one")
    unrolled, s_unr, n_unr = _run("transformer", 3, 1, "fp32", "one")
    out, ref = dp.params(s_scan), unrolled.params(s_unr)
    blocks = [ref.pop(f"block{i}") for i in range(LAYERS)]
    ref["blocks"] = {"block": jax.tree.map(lambda *xs: jnp.stack(xs), *blocks)}
    for a, b in zip(jax.tree.leaves(out), jax.tree.leaves(ref), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(n_scan, n_unr, rtol=1e-5)


def _engine(loss_fn=scan_mlp_loss, ndev=8, optimizer=None, **cfg):
    mesh = jaxdp.make_mesh(jax.devices()[:ndev])
    opt = optax.adam(1e-2) if optimizer is None else optimizer
    return DataParallel(loss_fn, opt, DDPConfig(**cfg), mesh=mesh)


def test_stack_at_axis_1_detected_and_trained():
    """nn.scan(variable_axes={"params": 1}): the stacked axis is inferred as 1.

    Momentum SGD, as the transformer runs of test_zero3.py: the attention key bias has a zero
    true gradient, so its gradient is rounding noise that Adam would scale to steps of ~lr,
    and the two programs (which fuse and recompute differently) round differently."""
    loss_fn = make_scan_transformer_loss(1)
    params = scan_transformer_params(param_axis=1)
    batch = make_transformer_batch()
    sgd = optax.sgd(0.3, momentum=0.9)
    dp = _engine(loss_fn, optimizer=sgd, zero_stage=3, num_microbatches=2)
    state = dp.init(params, example_batch=batch)
    assert len(dp.layout.stacked) == 12 and all(ax == 1 for _, ax in dp.layout.stacked)
    whole = _engine(loss_fn, optimizer=sgd, zero_stage=3, num_microbatches=2, scan_layers=False)
    s_whole = whole.init(params, example_batch=batch)
    for _ in range(2):
        state, m = dp.step(state, dp.shard_batch(batch))
        s_whole, m_whole = whole.step(s_whole, whole.shard_batch(batch))
    np.testing.assert_allclose(float(m["loss"]), float(m_whole["loss"]), rtol=1e-6)
    for a, b in zip(
        jax.tree.leaves(dp.params(state)), jax.tree.leaves(whole.params(s_whole)), strict=True
    ):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)


def make_transformer_batch():
    from _transformer import transformer_batches

    return transformer_batches(32, 1)[0]


def test_scan_param_patterns_mark_by_hand():
    params = scan_mlp_params()
    dp = _engine(zero_stage=3, scan_param_patterns=(("^stack/", 0),))
    dp.init(params)  # no batch: the patterns alone mark the stack
    assert [dp.layout.slots[i].path for i, _ in dp.layout.stacked] == ["stack/b", "stack/w"]
    with pytest.raises(ValueError, match="'nothing/here' matches no parameter"):
        _engine(zero_stage=3, scan_param_patterns=(("nothing/here", 0),)).init(params)
    with pytest.raises(ValueError, match="marks axis 2 of 'stack/b'"):
        _engine(zero_stage=3, scan_param_patterns=(("^stack/", 2),)).init(params)
    with pytest.raises(ValueError, match="bucket_layout='interleaved'"):
        DDPConfig(zero_stage=3, bucket_layout="megatron", scan_param_patterns=(("x", 0),))
    # detection off: nothing stacked, patterns ignored only when scan_layers=False
    off = _engine(zero_stage=3, scan_layers=False, scan_param_patterns=(("^stack/", 0),))
    off.init(params, example_batch=make_batch(48))
    assert off.layout.stacked == ()
    # below stage 3 nothing is stacked
    two = _engine(zero_stage=2)
    two.init(params, example_batch=make_batch(48))
    assert two.layout.stacked == ()


def test_warns_when_init_had_no_batch():
    dp = _engine(zero_stage=3)
    state = dp.init(scan_mlp_params())
    assert dp.layout.stacked == ()
    with pytest.warns(UserWarning, match=r"\['stack/b', 'stack/w'\] whole"):
        dp.step(state, dp.shard_batch(make_batch(48)))


@pytest.mark.parametrize(
    ("src", "dst"),
    [
        ((8, {"zero_stage": 3, "param_dtype": "bfloat16"}), (4, {"zero_stage": 0})),
        ((6, {"zero_stage": 1}), (8, {"zero_stage": 3, "num_microbatches": 2})),
        ((8, {"zero_stage": 3}), (6, {"zero_stage": 3, "scan_layers": False})),
        ((8, {"zero_stage": 3, "bucket_size": 64}), (3, {"zero_stage": 3})),
    ],
)
def test_checkpoint_scanned_across_stages(tmp_path, src, dst):
    (n_src, c_src), (n_dst, c_dst) = src, dst
    dt = c_src.get("param_dtype")
    c_dst = dict(c_dst, param_dtype=dt) if dt else c_dst
    batch = make_batch(48)
    eng = _engine(ndev=n_src, **c_src)
    state = eng.init(scan_mlp_params(), example_batch=batch)
    state, _ = eng.step(state, eng.shard_batch(batch))
    dst_eng = _engine(ndev=n_dst, **c_dst)
    jax.eval_shape(lambda p: dst_eng.init(p, example_batch=batch), scan_mlp_params())
    assert eng.layout.stacked or dst_eng.layout.stacked
    check_restores_exactly(tmp_path, eng, state, dst_eng)


def test_nan_check_names_the_stack():
    dp = _engine(zero_stage=3, check_for_nan_in_grad=True, num_microbatches=2)
    batch = make_batch(48)
    state = dp.init(scan_mlp_params(), example_batch=batch)
    state, _ = dp.step(state, dp.shard_batch(batch))
    bad = dict(batch, x=batch["x"].at[5, 0].set(jnp.nan))  # one example on rank 0
    with pytest.raises(FloatingPointError, match="stack/w") as info:
        dp.step(state, dp.shard_batch(bad))
    assert "on 1 of 8 ranks" in str(info.value)
    assert int(info.value.state.step) == 1


def test_nnx_scan_model():
    """An nnx model whose blocks are built by nnx.vmap and run by nnx.scan."""
    from flax import nnx
    from test_scan_gather import NModel

    graphdef, params = nnx.split(NModel(nnx.Rngs(0)), nnx.Param)

    def loss_fn(p, b):
        return nnx.merge(graphdef, p)(b["x"])

    batch = {"x": jnp.asarray(np.random.default_rng(0).standard_normal((32, 5)), jnp.float32)}
    runs = []
    for scan in (True, False):
        # Momentum SGD: Adam would scale the two programs' rounding noise in its smallest
        # gradients (3e-4 of the largest) up towards the tolerance.
        sgd = optax.sgd(0.3, momentum=0.9)
        dp = _engine(loss_fn, optimizer=sgd, zero_stage=3, num_microbatches=2, scan_layers=scan)
        state = dp.init(params, example_batch=batch)
        assert len(dp.layout.stacked) == (4 if scan else 0)
        for _ in range(2):
            state, m = dp.step(state, dp.shard_batch(batch))
        runs.append((dp.params(state), float(m["loss"])))
    (a, la), (b, lb) = runs
    np.testing.assert_allclose(la, lb, rtol=1e-6)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_allclose(x, y, rtol=2e-6, atol=1e-8)


@pytest.mark.parametrize("dp", [1, 3, 8])
@pytest.mark.parametrize("axis", [0, 1])
def test_layout_stores_stacks_per_layer(dp, axis):
    rng = np.random.default_rng(0)
    params = {"s": jnp.asarray(rng.standard_normal((5, 4, 3)), jnp.float32), "w": jnp.ones((7,))}
    layout = jaxdp.BucketLayout.from_params(params, DDPConfig(zero_stage=3), dp, {0: axis})
    assert layout.stacked == ((0, axis),)
    s = layout.slots[0]
    assert layout.buckets[s.bucket].slots == (0,)  # a bucket of its own
    n_layers = params["s"].shape[axis]
    layer = np.moveaxis(np.asarray(params["s"]), axis, 0).reshape(n_layers, -1)
    p = -(-layer.shape[1] // dp)
    padded = np.pad(layer, ((0, 0), (0, dp * p - layer.shape[1])))
    view = layout.to_global_view(params)["s"]
    # rank r's contiguous block of the global view is piece r of every layer
    for r in range(dp):
        block = np.asarray(view).reshape(dp, n_layers, p)[r]
        np.testing.assert_array_equal(block, padded[:, r * p : (r + 1) * p])
    back = layout.from_global_view(layout.to_global_view(params))
    unpacked = layout.unpack(layout.pack(params))
    for tree in (back, unpacked):
        for a, b in zip(jax.tree.leaves(tree), jax.tree.leaves(params), strict=True):
            np.testing.assert_array_equal(a, b)


def test_scan_counts_reads_both_jax_param_forms():
    """jax <= 0.10 names a scan's operand groups (num_consts, num_carry); jax 0.11 packs them
    into a flat tree ``ft_in`` of (consts, carry, xs). The rewrite reads either; the GPU hosts
    run 0.11, where reading the old names raised KeyError at stage 3."""
    from jaxdp._src.zero3.scan_rewrite import scan_counts

    class _Packed:  # jax 0.11's FlatTree: unpack() -> one sized group per part
        def unpack(self):
            return ([None] * 3, [None] * 2, [None] * 5)

    assert scan_counts({"num_consts": 3, "num_carry": 2, "length": 4}) == (3, 2)
    assert scan_counts({"ft_in": _Packed(), "length": 4}) == (3, 2)
    with pytest.raises(NotImplementedError, match="num_consts nor ft_in"):
        scan_counts({"length": 4})
    # The installed jax's own scan equation.
    jaxpr = jax.make_jaxpr(lambda c, xs: jax.lax.scan(lambda a, x: (a + x, a * x), c, xs))(
        1.0, jnp.ones(4)
    )
    (eqn,) = [e for e in jaxpr.jaxpr.eqns if e.primitive.name == "scan"]
    assert scan_counts(eqn.params) == (0, 1)
