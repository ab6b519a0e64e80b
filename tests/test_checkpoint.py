"""CheckpointManager: exact restore across device counts, ZeRO stages and bucket layouts."""

import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _models import make_batch, mlp_params, mse_loss

import jaxdp
from jaxdp import CheckpointManager, CheckpointMismatchError, DataParallel, DDPConfig
from jaxdp.testing import tolerance


def _optimizer():
    # A mask makes optax's state hold empty MaskedNode leaves: the canonical form must keep them.
    mask = jax.tree.map(lambda p: p.ndim > 1, mlp_params())
    return optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-2, mask=mask))


def _engine(ndev=8, opt=None, **cfg):
    mesh = jaxdp.make_mesh(jax.devices()[:ndev])
    return DataParallel(mse_loss, opt or _optimizer(), DDPConfig(**cfg), mesh=mesh)


def _trained(ndev=8, steps=2, opt=None, **cfg):
    eng = _engine(ndev, opt, **cfg)
    state = eng.init(mlp_params())
    for s in range(steps):
        state, _ = eng.step(state, eng.shard_batch(make_batch(48, seed=s)))
    return eng, state


def _canonical(eng, state):
    """Params, master and optimizer state in param shapes, as numpy (the reference view)."""
    layout = eng.layout
    master = eng.params(state)
    opt = state.opt_state
    if eng.config.zero_stage >= 1:

        def conv(path, x):
            keys = [p for p in path]
            for s in layout.slots:
                if s.path == jaxdp.path_str(tuple(keys[-2:])) and x.shape == (
                    (s.end - s.start) * layout.dp_size,
                ):
                    return np.asarray(x)[: s.size].reshape(s.shape)
            return np.asarray(x)

        opt = jax.tree_util.tree_map_with_path(conv, opt)
    return (
        [np.asarray(x) for x in jax.tree.leaves(master)],
        [np.asarray(x) for x in jax.tree.leaves(opt)],
        int(state.step),
    )


def _assert_same(a, b):
    (ma, oa, sa), (mb, ob, sb) = a, b
    assert sa == sb
    assert len(ma) == len(mb) and len(oa) == len(ob)
    for x, y in zip(ma + oa, mb + ob, strict=True):
        assert x.shape == y.shape and x.dtype == y.dtype
        np.testing.assert_array_equal(x, y)


@pytest.mark.parametrize(
    ("src", "dst"),
    [
        ((8, {"zero_stage": 1}), (8, {"zero_stage": 1})),
        ((8, {"zero_stage": 1}), (4, {"zero_stage": 1})),
        ((8, {"zero_stage": 1}), (8, {"zero_stage": 2, "num_microbatches": 2})),
        ((8, {"zero_stage": 1}), (3, {"zero_stage": 0})),
        ((4, {"zero_stage": 0}), (6, {"zero_stage": 2, "bucket_size": 100})),
        ((8, {"zero_stage": 2, "bucket_size": 64}), (2, {"zero_stage": 1})),
        # Across working dtypes the weights of record carry over exactly: a bf16 run's fp32
        # master becomes an fp32 run's params, an fp32 run's params a bf16 run's master.
        ((8, {"zero_stage": 2, "param_dtype": "bfloat16"}), (4, {"zero_stage": 0})),
        ((6, {"zero_stage": 0}), (3, {"zero_stage": 3, "param_dtype": "bfloat16"})),
        ((8, {"zero_stage": 0, "param_dtype": "bfloat16"}), (6, {"zero_stage": 1})),
        ((4, {"zero_stage": 1}), (8, {"zero_stage": 0, "param_dtype": "bfloat16"})),
        # flat <-> hierarchical <-> another number of instances
        ((8, {"zero_stage": 1}), (8, {"zero_stage": 1, "num_distributed_optimizer_instances": 2})),
        (
            (8, {"zero_stage": 2, "num_distributed_optimizer_instances": 4}),
            (
                6,
                {
                    "zero_stage": 3,
                    "num_distributed_optimizer_instances": 3,
                    "outer_dp_sharding_strategy": "optim",
                },
            ),
        ),
        (
            (
                8,
                {
                    "zero_stage": 3,
                    "num_distributed_optimizer_instances": 2,
                    "outer_dp_sharding_strategy": "optim",
                },
            ),
            (4, {"zero_stage": 1}),
        ),
    ],
)
def test_restore_reshards_exactly(tmp_path, src, dst):
    eng, state = _trained(src[0], **src[1])
    want = _canonical(eng, state)
    with CheckpointManager(tmp_path, eng) as ckpt:
        ckpt.save(2, state)
        ckpt.wait_until_finished()
    eng2 = _engine(dst[0], **dst[1])
    jax.eval_shape(eng2.init, mlp_params())
    with CheckpointManager(tmp_path, eng2) as ckpt2:
        restored = ckpt2.restore()
    assert jax.tree.structure(restored) == jax.tree.structure(
        jax.eval_shape(eng2.init, mlp_params())
    )
    for x, sh in zip(jax.tree.leaves(restored), jax.tree.leaves(eng2.state_shardings)):
        assert x.sharding.is_equivalent_to(sh, x.ndim)
    _assert_same(_canonical(eng2, restored), want)
    # The restored state trains: one more step on both sides gives the same loss to rounding
    # (the rounding of the working dtype where one side computes in bf16).
    _, m1 = eng.step(state, eng.shard_batch(make_batch(48, seed=9)))
    _, m2 = eng2.step(restored, eng2.shard_batch(make_batch(48, seed=9)))
    bf16 = "bfloat16" in (src[1].get("param_dtype"), dst[1].get("param_dtype"))
    rtol = tolerance(jnp.bfloat16) if bf16 else 1e-6
    np.testing.assert_allclose(float(m1["loss"]), float(m2["loss"]), rtol=rtol)


def test_megatron_layout_round_trip(tmp_path):
    # Megatron's contiguous buckets give the optimizer flat shards: no masks, plain Adam.
    adam = optax.adam(1e-2)
    eng, state = _trained(8, opt=adam, zero_stage=1, bucket_layout="megatron", bucket_size=200)
    ref_master = [np.asarray(x) for x in jax.tree.leaves(eng.params(state))]
    with CheckpointManager(tmp_path, eng) as ckpt:
        ckpt.save(1, state)
    eng2 = _engine(4, adam, zero_stage=1)
    jax.eval_shape(eng2.init, mlp_params())
    with CheckpointManager(tmp_path, eng2) as ckpt2:
        restored = ckpt2.restore(1)
    got = [np.asarray(x) for x in jax.tree.leaves(eng2.params(restored))]
    for x, y in zip(got, ref_master, strict=True):
        np.testing.assert_array_equal(x, y)
    for field in ("mu", "nu"):
        want = eng.layout.from_global_view(getattr(state.opt_state[0], field))
        have = eng2.layout.from_global_view(getattr(restored.opt_state[0], field))
        for x, y in zip(jax.tree.leaves(have), jax.tree.leaves(want), strict=True):
            np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_steps_max_to_keep_and_partial_save(tmp_path):
    eng, state = _trained(8, steps=1, zero_stage=1)
    ckpt = CheckpointManager(tmp_path, eng, max_to_keep=2)
    assert ckpt.latest_step() is None and ckpt.all_steps() == []
    for s in (1, 2, 3):
        ckpt.save(s, state)
    ckpt.wait_until_finished()
    assert ckpt.all_steps() == [2, 3] and ckpt.latest_step() == 3
    ckpt.close()
    # A save killed mid-way leaves orbax's temporary folder behind, never a committed step.
    shutil.copytree(tmp_path / "3", tmp_path / "4.orbax-checkpoint-tmp-1234")
    for root, _, files in os.walk(tmp_path / "4.orbax-checkpoint-tmp-1234"):
        for f in files[: len(files) // 2]:
            os.remove(os.path.join(root, f))
    ckpt = CheckpointManager(tmp_path, eng)
    assert ckpt.latest_step() == 3
    restored = ckpt.restore()
    _assert_same(_canonical(eng, restored), _canonical(eng, state))
    ckpt.close()


def test_other_model_is_refused(tmp_path):
    eng, state = _trained(8, steps=1, zero_stage=1)
    with CheckpointManager(tmp_path, eng) as ckpt:
        ckpt.save(1, state)
    sizes = (6, 16, 8, 4)

    def loss(p, b):
        return jnp.mean(b["x"][:, :1] * 0) + sum(jnp.sum(x) for x in jax.tree.leaves(p))

    other = DataParallel(loss, optax.adam(1e-2), DDPConfig(zero_stage=1))
    jax.eval_shape(other.init, mlp_params(sizes=sizes))
    with (
        CheckpointManager(tmp_path, other) as c2,
        pytest.raises(CheckpointMismatchError, match=r"\['layer1'\]\['b'\] has shape \(16,\)"),
    ):
        c2.restore()
    # Same model, another optimizer (plain adam: no clip state, no mask).
    adam = DataParallel(mse_loss, optax.adam(1e-2), DDPConfig(zero_stage=1))
    jax.eval_shape(adam.init, mlp_params())
    with CheckpointManager(tmp_path, adam) as c3, pytest.raises(CheckpointMismatchError):
        c3.restore()
    with CheckpointManager(tmp_path, eng) as c4, pytest.raises(FileNotFoundError, match="step=7"):
        c4.restore(7)


def test_bad_arguments(tmp_path):
    eng, _ = _trained(8, steps=0)
    with pytest.raises(TypeError, match="engine"):
        CheckpointManager(tmp_path, "engine")
    with pytest.raises(ValueError, match="max_to_keep=0"):
        CheckpointManager(tmp_path, eng, max_to_keep=0)
    fresh = _engine(8)
    with pytest.raises(RuntimeError, match="init"):
        CheckpointManager(tmp_path, fresh)
