"""``DDPConfig.optimizer_cpu_offload``: the master weights and optimizer state in pinned host
memory between steps, brought in bucket by bucket; values bit-equal to the on-device run."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jaxdp import CheckpointManager, DataParallel, DDPConfig, make_mesh
from jaxdp._src.strategy import offload


def loss_fn(p, b):
    h = jnp.tanh(b["x"] @ p["w1"] + p["b1"])
    return jnp.mean((h @ p["w2"] - b["y"]) ** 2)


def _data():
    k = jax.random.split(jax.random.key(0), 4)
    params = {
        "w1": jax.random.normal(k[0], (12, 20)),
        "b1": jnp.zeros(20),
        "w2": jax.random.normal(k[1], (20, 3)),
    }
    batch = {"x": jax.random.normal(k[2], (24, 12)), "y": jax.random.normal(k[3], (24, 3))}
    return params, batch


def _engine(dp, stage=1, g=1, optimizer=None, **kw):
    cfg = DDPConfig(
        zero_stage=stage, num_microbatches=g, bucket_size=300, param_dtype="bfloat16", **kw
    )
    return DataParallel(
        loss_fn, optimizer or optax.adamw(1e-2), cfg, mesh=make_mesh(jax.devices()[:dp])
    )


def _kinds(tree):
    return {x.sharding.memory_kind for x in jax.tree.leaves(tree)}


def _train(eng, params, batch, steps=5):
    state = eng.init(params)
    for _ in range(steps):
        state, _ = eng.step(state, eng.shard_batch(batch))
    return state


def test_state_lives_in_host_memory():
    params, batch = _data()
    eng = _engine(4, optimizer_cpu_offload=True)
    state = _train(eng, params, batch, steps=1)
    assert _kinds((state.master, state.opt_state)) == {"pinned_host"}
    assert _kinds(state.params) == {"device"}
    sh = eng.state_shardings
    assert _kinds_of(sh.opt_state) == {"pinned_host"}
    off = _train(_engine(4), params, batch, steps=1)
    assert _kinds((off.master, off.opt_state, off.params)) == {"device"}


def _kinds_of(shardings):
    return {s.memory_kind for s in jax.tree.leaves(shardings)}


def test_fraction_offloads_the_first_buckets():
    params, batch = _data()
    eng = _engine(4, optimizer_cpu_offload=True, optimizer_offload_fraction=0.5)
    state = _train(eng, params, batch, steps=1)
    off = eng.plan.strategy.offload
    assert off is not None and 0 < len(off.buckets) < len(eng.layout.buckets)
    assert min(off.buckets) == 0
    buckets = eng.layout.view_leaf_buckets()
    for b, x in zip(buckets, jax.tree.leaves(state.master), strict=True):
        assert x.sharding.memory_kind == ("pinned_host" if b in off.buckets else "device")
    ref = _train(_engine(4), params, batch)
    got = _train(eng, params, batch)
    _assert_equal(ref, got, eng)


def _assert_equal(ref_state, state, eng, ref_eng=None):
    want = (ref_eng or eng).params(ref_state)
    for a, b in zip(jax.tree.leaves(want), jax.tree.leaves(eng.params(state)), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize(
    "stage,dp,g",
    [(1, 4, 1), (1, 3, 2), (3, 4, 2), (3, 6, 1), (2, 6, 2), (0, 3, 1)],
)
def test_bit_equal_to_on_device(stage, dp, g):
    params, batch = _data()
    ref_eng = _engine(dp, stage, g)
    eng = _engine(dp, stage, g, optimizer_cpu_offload=True)
    ref, got = _train(ref_eng, params, batch), _train(eng, params, batch)
    _assert_equal(ref, got, eng)
    for a, b in zip(jax.tree.leaves(ref.opt_state), jax.tree.leaves(got.opt_state), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_update_is_split_by_bucket_or_whole(monkeypatch):
    """Adam splits by bucket; a global norm inside the optimizer reads every bucket, so the
    update runs whole, with the same values."""
    seen = []
    split = offload.split_by_bucket

    def spy(jaxpr, buckets):
        seen.append(split(jaxpr, buckets))
        return seen[-1]

    monkeypatch.setattr(offload, "split_by_bucket", spy)
    params, batch = _data()
    eng = _engine(4, 3, optimizer_cpu_offload=True)
    _train(eng, params, batch, steps=1)
    assert not seen[-1].whole
    assert [b for b, _, _ in seen[-1].groups if b is not None] == list(
        range(len(eng.layout.buckets))
    )
    clipped = optax.chain(optax.clip_by_global_norm(0.1), optax.adam(1e-2))
    eng = _engine(4, 3, optimizer=clipped, optimizer_cpu_offload=True)
    got = _train(eng, params, batch)
    assert seen[-1].whole
    _assert_equal(_train(_engine(4, 3, optimizer=clipped), params, batch), got, eng)


def test_checkpoint_round_trip(tmp_path):
    params, batch = _data()
    eng = _engine(4, optimizer_cpu_offload=True)
    state = _train(eng, params, batch, steps=2)
    with CheckpointManager(tmp_path / "off", eng) as cm:
        cm.save(2, state)
        cm.wait_until_finished()
    ref_eng = _engine(4)
    want = _train(ref_eng, params, batch, steps=4)
    for target in (
        _engine(4, optimizer_cpu_offload=True),
        _engine(4),
        _engine(4, 3, optimizer_cpu_offload=True),
    ):
        target.init(params)
        with CheckpointManager(tmp_path / "off", target) as cm:
            restored = cm.restore()
        offloaded = target.config.optimizer_cpu_offload
        assert _kinds(restored.opt_state) == {"pinned_host" if offloaded else "device"}
        for _ in range(2):
            restored, _ = target.step(restored, target.shard_batch(batch))
        _assert_equal(want, restored, target, ref_eng)
    # an on-device checkpoint into an offloading engine
    plain = _engine(4)
    plain_state = _train(plain, params, batch, steps=2)
    with CheckpointManager(tmp_path / "dev", plain) as cm:
        cm.save(2, plain_state)
        cm.wait_until_finished()
    eng.init(params)
    with CheckpointManager(tmp_path / "dev", eng) as cm:
        restored = cm.restore()
    assert _kinds(restored.master) == {"pinned_host"}
    for _ in range(2):
        restored, _ = eng.step(restored, eng.shard_batch(batch))
    _assert_equal(want, restored, eng, ref_eng)


@pytest.mark.parametrize(
    "kw,exc,words",
    [
        (dict(optimizer_cpu_offload=1), TypeError, "optimizer_cpu_offload"),
        (dict(optimizer_cpu_offload=True, optimizer_offload_fraction=0.0), ValueError, "(0, 1]"),
        (dict(optimizer_cpu_offload=True, optimizer_offload_fraction=1.5), ValueError, "(0, 1]"),
        (dict(optimizer_cpu_offload=True, optimizer_offload_fraction="half"), TypeError, "float"),
        (dict(optimizer_offload_fraction=0.5), ValueError, "optimizer_cpu_offload=True"),
    ],
)
def test_bad_values(kw, exc, words):
    with pytest.raises(exc, match="optimizer_") as e:
        DDPConfig(**kw)
    assert words in str(e.value) and "Fix:" in str(e.value)


def test_compile_only_devices_are_refused_and_cross_compiled(h100):
    from jaxdp import aot

    params = {"w": jax.ShapeDtypeStruct((512, 512), jnp.float32)}
    batch = {"x": jax.ShapeDtypeStruct((64, 512), jnp.float32)}

    def lf(p, b):
        return jnp.mean(jnp.tanh(b["x"] @ p["w"]))

    cfg = DDPConfig(zero_stage=1, optimizer_cpu_offload=True)
    with pytest.raises(ValueError, match=r"pinned_host.*cross_compile_step"):
        aot.abstract_state(DataParallel(lf, optax.adam(1e-3), cfg, mesh=h100), params)
    cpu = make_mesh(jax.devices("cpu")[:8])
    targets = list(h100.devices.flat)
    mem = {}
    for off in (False, True):
        dp = DataParallel(lf, optax.adam(1e-3), cfg.replace(optimizer_cpu_offload=off), mesh=cpu)
        mem[off] = aot.cross_compile_step(dp, params, batch, targets).memory_analysis()
    state = 512 * 512 // 8 * 12  # fp32 master and Adam's two moments, per device
    assert mem[True].host_argument_size_in_bytes >= state
    assert mem[False].host_argument_size_in_bytes == 0
    assert mem[False].argument_size_in_bytes - mem[True].argument_size_in_bytes >= state


@pytest.mark.parametrize("stage", [1, 3])
def test_device_bytes_drop_by_the_state_less_one_bucket(h100, stage):
    """The issue's bound, on compile-only GPUs: with the state offloaded, the device bytes drop
    by its bytes less at most one bucket's share (the bucket in flight). Without the norm
    ahead of the first bucket (offload.update_by_bucket's ``start_after``) XLA brought that
    bucket in at the start of the step and kept it through the backward pass: 1.1-1.3
    buckets short here."""
    from jaxdp import aot

    loss, params, batch = aot.example_mlp(layers=6, width=256, batch=64)
    cpu = make_mesh(jax.devices("cpu")[:8])
    total = {}
    for off in (False, True):
        cfg = DDPConfig(
            zero_stage=stage,
            param_dtype="bfloat16",
            bucket_size=70_000,
            optimizer_cpu_offload=off,
        )
        dp = DataParallel(loss, optax.adam(1e-3), cfg, mesh=cpu)
        m = aot.cross_compile_step(dp, params, batch, list(h100.devices.flat)).memory_analysis()
        total[off] = (
            m.argument_size_in_bytes
            + m.output_size_in_bytes
            - m.alias_size_in_bytes
            + m.temp_size_in_bytes
        )
    numels = [b.numel for b in dp.layout.buckets]
    assert len(numels) >= 3
    state = sum(numels) // 8 * 12  # fp32 master and Adam's two moments, per device
    bucket = max(numels) // 8 * 12
    assert state - (total[False] - total[True]) <= bucket
