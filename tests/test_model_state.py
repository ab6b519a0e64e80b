"""The whole flax training state: BatchNorm statistics (model_state), dropout keys (rng), aux.

Every engine run is checked against ``jaxdp.testing.Reference``, the same per-rank,
per-micro-batch computation on one device (same keys, BatchNorm per rank or synchronised over
the data axis), to the fp32 tolerance ``jaxdp.testing.tolerance`` derives.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jaxdp
from jaxdp import CheckpointManager, DataParallel, DDPConfig, LossOutput, make_mesh
from jaxdp.testing import Reference, assert_matches_reference, reduced_gradient

CLASSES = 3


class LinenCNN(nn.Module):
    sync: bool = False  # BatchNorm over the whole global micro-batch (the data axis)

    @nn.compact
    def __call__(self, x, train: bool):
        x = nn.Conv(4, (3, 3), use_bias=False)(x)  # a bias before BatchNorm gets no gradient
        x = nn.BatchNorm(use_running_average=not train, axis_name="data" if self.sync else None)(x)
        x = nn.relu(x)
        x = nn.Dropout(0.3, deterministic=not train)(x)
        return nn.Dense(CLASSES)(x.mean((1, 2)))


def linen_setup(sync=False):
    model = LinenCNN(sync)
    v = model.init(jax.random.key(0), jnp.zeros((1, 6, 6, 1)), train=False)

    def loss_fn(p, b, *, model_state, rng):
        logits, new = model.apply(
            {"params": p, **model_state},
            b["x"],
            train=True,
            mutable=list(model_state),
            rngs={"dropout": rng},
        )
        ce = optax.softmax_cross_entropy_with_integer_labels(logits, b["y"]).mean()
        acc = jnp.mean(logits.argmax(-1) == b["y"])
        return LossOutput(ce, aux={"accuracy": acc}, model_state=new)

    return loss_fn, v["params"], {"batch_stats": v["batch_stats"]}


class NnxCNN(nnx.Module):
    def __init__(self, sync: bool, rngs: nnx.Rngs):
        self.conv = nnx.Conv(1, 4, (3, 3), use_bias=False, rngs=rngs)
        self.bn = nnx.BatchNorm(4, axis_name="data" if sync else None, rngs=rngs)
        self.drop = nnx.Dropout(0.3)
        self.out = nnx.Linear(4, CLASSES, rngs=rngs)

    def __call__(self, x, rng):
        x = self.drop(nnx.relu(self.bn(self.conv(x))), rngs=rng)
        return self.out(x.mean((1, 2)))


def nnx_setup(sync=False):
    graphdef, params, stats = nnx.split(NnxCNN(sync, nnx.Rngs(0)), nnx.Param, nnx.BatchStat)

    def loss_fn(p, b, *, model_state, rng):
        m = nnx.merge(graphdef, p, model_state)
        logits = m(b["x"], rng)
        ce = optax.softmax_cross_entropy_with_integer_labels(logits, b["y"]).mean()
        return LossOutput(ce, model_state=nnx.state(m, nnx.BatchStat))

    return loss_fn, params, stats


def batches(n, steps, seed=0):
    rng = np.random.default_rng(seed)
    return [
        {
            "x": jnp.asarray(rng.standard_normal((n, 6, 6, 1)), jnp.float32),
            "y": jnp.asarray(rng.integers(0, CLASSES, n), jnp.int32),
        }
        for _ in range(steps)
    ]


def run_both(setup, cfg, mesh=None, steps=2, sync=False, key=1):
    loss_fn, params, ms = setup(sync)
    dp = DataParallel(loss_fn, optax.adam(1e-2), cfg, mesh=mesh)
    ref = Reference(loss_fn, optax.adam(1e-2), cfg, dp=dp.dp)
    rng = jax.random.key(key)
    state = dp.init(params, model_state=ms, rng=rng)
    ref_state = ref.init(params, model_state=ms, rng=rng)
    n = 2 * dp.dp * cfg.num_microbatches
    for b in batches(n, steps):
        state, m = dp.step(state, dp.shard_batch(b))
        ref_state, rm = ref.step(ref_state, b)
        np.testing.assert_allclose(float(m["grad_norm"]), float(rm["grad_norm"]), rtol=1e-5)
    return dp, state, ref, ref_state


@pytest.mark.parametrize("g", [1, 4])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_linen_cnn_matches_reference(stage, g):
    # every stage runs BatchNorm per rank at one G and synchronised at the other
    sync = (stage % 2 == 0) != (g == 4)
    cfg = DDPConfig(zero_stage=stage, num_microbatches=g)
    dp, state, ref, ref_state = run_both(linen_setup, cfg, sync=sync)
    assert_matches_reference(dp, state, ref, ref_state)
    stats = dp.model_state(state)["batch_stats"]
    assert not np.allclose(stats["BatchNorm_0"]["mean"], 0.0)  # the statistics did move


@pytest.mark.parametrize("g", [1, 4])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_nnx_cnn_matches_reference(stage, g):
    cfg = DDPConfig(zero_stage=stage, num_microbatches=g)
    dp, state, ref, ref_state = run_both(nnx_setup, cfg, sync=(stage % 2 == 1) != (g == 4))
    assert_matches_reference(dp, state, ref, ref_state)


@pytest.mark.parametrize("n", [3, 6])
@pytest.mark.parametrize("sync", ["mean", "broadcast"])
def test_odd_device_counts_and_broadcast_sync(n, sync):
    cfg = DDPConfig(zero_stage=2, num_microbatches=2, model_state_sync=sync)
    mesh = make_mesh(jax.devices()[:n])
    dp, state, ref, ref_state = run_both(linen_setup, cfg, mesh=mesh)
    assert_matches_reference(dp, state, ref, ref_state)


def mask_engine(stage, g, key=0):
    """A loss whose reduced gradient is every global micro-batch position's dropout mask:
    row ``p`` of ``w`` is used only by the examples of position ``p`` (their ``pos``)."""
    k = 64

    def loss_fn(p, b, *, rng):
        keep = jax.random.bernoulli(rng, 0.5, (k,)).astype(jnp.float32)
        rows = p["w"][b["pos"]]  # [examples, k]
        return jnp.mean(jnp.sum(rows * keep, -1))

    dp = DataParallel(loss_fn, optax.sgd(0.0), DDPConfig(zero_stage=stage, num_microbatches=g))
    positions = dp.dp * g
    state = dp.init({"w": jnp.zeros((positions, k))}, rng=jax.random.key(key))
    batch = {"pos": jnp.repeat(jnp.arange(positions, dtype=jnp.int32), 2)}
    return dp, state, batch, positions


@pytest.mark.parametrize("stage,g", [(0, 4), (3, 2)])
def test_dropout_masks_differ_across_ranks_microbatches_and_steps(stage, g):
    dp, state, batch, positions = mask_engine(stage, g)
    masks = []
    for s in range(2):
        grad = np.asarray(reduced_gradient(dp, state, batch)["w"]) * positions
        # exactly the masks of fold_in(fold_in(rng, step), position), position = rank * G + m
        base = jax.random.fold_in(jax.random.key(0), s)
        want = np.stack(
            [
                jax.random.bernoulli(jax.random.fold_in(base, p), 0.5, (64,))
                for p in range(positions)
            ]
        ).astype(np.float32)
        np.testing.assert_allclose(grad, want, atol=1e-6)
        masks.append(want)
        state, _ = dp.step(state, dp.shard_batch(batch))
    rows = np.concatenate(masks)
    assert len({r.tobytes() for r in rows}) == len(rows)  # every rank, micro-batch and step


def test_one_rng_gives_one_run():
    def final(key):
        cfg = DDPConfig(zero_stage=1, num_microbatches=2)
        loss_fn, params, ms = linen_setup()
        dp = DataParallel(loss_fn, optax.adam(1e-2), cfg)
        state = dp.init(params, model_state=ms, rng=jax.random.key(key))
        for b in batches(32, 2):
            state, _ = dp.step(state, dp.shard_batch(b))
        return jax.tree.leaves((dp.params(state), dp.model_state(state)))

    a, b, c = final(1), final(1), final(2)
    assert all(np.array_equal(x, y) for x, y in zip(a, b, strict=True))
    assert not all(np.array_equal(x, y) for x, y in zip(a, c, strict=True))


def test_model_state_and_key_survive_a_checkpoint_at_another_device_count_and_stage(tmp_path):
    loss_fn, params, ms = linen_setup()
    src = DataParallel(loss_fn, optax.adam(1e-2), DDPConfig(zero_stage=1, num_microbatches=2))
    state = src.init(params, model_state=ms, rng=jax.random.key(7))
    for b in batches(32, 2):
        state, _ = src.step(state, src.shard_batch(b))
    with CheckpointManager(tmp_path, src) as ckpt:
        ckpt.save(2, state)
        ckpt.wait_until_finished()
    dst = DataParallel(
        loss_fn, optax.adam(1e-2), DDPConfig(zero_stage=3), mesh=make_mesh(jax.devices()[:4])
    )
    jax.eval_shape(lambda p, m, k: dst.init(p, model_state=m, rng=k), params, ms, jax.random.key(0))
    with CheckpointManager(tmp_path, dst) as ckpt:
        back = ckpt.restore()
    for x, y in zip(
        jax.tree.leaves(src.model_state(state)), jax.tree.leaves(dst.model_state(back)), strict=True
    ):
        np.testing.assert_array_equal(x, y)
    np.testing.assert_array_equal(jax.random.key_data(back.rng), jax.random.key_data(state.rng))
    for x, y in zip(jax.tree.leaves(src.params(state)), jax.tree.leaves(dst.params(back))):
        np.testing.assert_array_equal(x, y)
    assert int(back.step) == 2
    # the restored engine keeps training (its keys: step 2's stream)
    back, m = dst.step(back, dst.shard_batch(batches(16, 1)[0]))
    assert np.isfinite(float(m["loss"]))

    # an engine without model_state / rng is refused with the fix
    plain = DataParallel(loss_fn, optax.adam(1e-2), DDPConfig(zero_stage=3))
    jax.eval_shape(plain.init, params)
    with (
        CheckpointManager(tmp_path, plain) as ckpt,
        pytest.raises(jaxdp.CheckpointMismatchError, match="holds a model_state"),
    ):
        ckpt.restore()


def test_contract_errors_and_the_aux_warning():
    loss_fn, params, ms = linen_setup()
    b = batches(16, 1)[0]

    def no_state(p, b, *, model_state, rng):
        return loss_fn(p, b, model_state=model_state, rng=rng).loss

    dp = DataParallel(no_state, optax.sgd(0.1), DDPConfig())
    state = dp.init(params, model_state=ms, rng=jax.random.key(0))
    with pytest.raises(ValueError, match="must return the updated one"):
        dp.step(state, dp.shard_batch(b))

    def bad_shape(p, b, *, model_state, rng):
        out = loss_fn(p, b, model_state=model_state, rng=rng)
        return out._replace(model_state=jax.tree.map(lambda x: x[:2], out.model_state))

    dp = DataParallel(bad_shape, optax.sgd(0.1), DDPConfig())
    state = dp.init(params, model_state=ms, rng=jax.random.key(0))
    with pytest.raises(ValueError, match=r"model_state leaf .*mean.* with shape \(2,\)"):
        dp.step(state, dp.shard_batch(b))

    dp = DataParallel(loss_fn, optax.sgd(0.1), DDPConfig())
    with pytest.raises(TypeError, match=r"rng=jax\.random\.key"):
        dp.init(params, model_state=ms, rng=3)
    with pytest.raises(TypeError, match=r"model_state leaf \['key'\] is a PRNG key"):
        dp.init(params, model_state={**ms, "key": jax.random.key(0)})
    with pytest.raises(ValueError, match="model_state_sync"):
        DDPConfig(model_state_sync="max")

    def stray_state(p, b):
        return LossOutput(jnp.mean(b["x"]) * 0 + jnp.sum(p["Dense_0"]["bias"]), model_state={})

    dp = DataParallel(stray_state, optax.sgd(0.1), DDPConfig())
    state = dp.init(params)
    with pytest.raises(ValueError, match="init got no model_state"):
        dp.step(state, dp.shard_batch(b))

    def per_example_aux(p, b):
        return jnp.sum(p["Dense_0"]["bias"]) ** 2, {"x0": b["x"][:, 0, 0, 0], "ok": jnp.ones(3)}

    dp = DataParallel(per_example_aux, optax.sgd(0.1), DDPConfig())
    state = dp.init(params)
    with pytest.warns(UserWarning, match=r"aux leaves \['x0'\] lead with the micro-batch"):
        state, m = dp.step(state, dp.shard_batch(b))
    assert m["aux"]["ok"].shape == (3,)


def test_legacy_prng_key_and_no_extras_keep_working():
    loss_fn, params, ms = linen_setup()
    dp = DataParallel(loss_fn, optax.sgd(0.1), DDPConfig(zero_stage=1))
    state = dp.init(params, model_state=ms, rng=jax.random.PRNGKey(0))  # raw uint32[2]
    assert jax.dtypes.issubdtype(state.rng.dtype, jax.dtypes.prng_key)
    state, _ = dp.step(state, dp.shard_batch(batches(16, 1)[0]))
    plain = DataParallel(lambda p, b: jnp.sum(p["w"] ** 2), optax.sgd(0.1), DDPConfig())
    s = plain.init({"w": jnp.ones(3)})
    assert s.model_state is None and s.rng is None and plain.model_state(s) is None
