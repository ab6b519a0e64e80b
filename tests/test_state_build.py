"""``init`` built from one small program per kind of leaf (``jaxdp._src.engine.state_build``): the
same
state as the one-program path, bit for bit and sharding for sharding, and chosen only where
it compiles less."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _models import counting_compiles

import jaxdp._src.engine.engine as engine_module
import jaxdp._src.engine.state_build as state_build
from jaxdp import DataParallel, DDPConfig, make_mesh


def deep_params(layers, seed=0, width=13):
    """``layers`` dense layers of one shape: two kinds of leaf, ``2 * layers`` leaves."""
    rng = np.random.default_rng(seed)
    return {
        f"layer_{i:02d}": {
            "kernel": rng.standard_normal((width, width - 2)).astype(np.float32),
            "bias": rng.standard_normal((width - 2,)).astype(np.float32),
        }
        for i in range(layers)
    }


def loss_fn(params, batch, model_state=None):
    h = batch["x"]
    for name in sorted(params):
        h = jnp.tanh(h @ params[name]["kernel"][: h.shape[-1]] + params[name]["bias"][0])
    return jnp.mean(h**2)


def build(stage, dp_size, per_leaf, monkeypatch, params, *, mesh=None, **init_kw):
    """``init``'s state with the per-leaf path allowed or not, whether it was taken and how
    many programs it compiled (on ``mesh``, else on the first ``dp_size`` devices)."""
    if not per_leaf:
        monkeypatch.setattr(engine_module, "per_leaf_plan", lambda *a, **k: None)
    else:
        monkeypatch.setattr(engine_module, "per_leaf_plan", state_build.per_leaf_plan)
    mesh = mesh or make_mesh(devices=jax.devices()[:dp_size])
    cfg = DDPConfig(zero_stage=stage, **init_kw.pop("config", {}))
    dp = DataParallel(loss_fn, optax.adamw(1e-2), cfg, mesh=mesh)
    taken = []
    build_state = state_build.build_state
    monkeypatch.setattr(
        engine_module, "build_state", lambda *a, **k: taken.append(1) or build_state(*a, **k)
    )
    with counting_compiles() as compiles:
        state = dp.init(params, **init_kw)
        jax.block_until_ready(state)
    return dp, state, bool(taken), len(compiles)


def assert_same_state(a, b):
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(la, lb, strict=True):
        assert x.shape == y.shape and x.dtype == y.dtype
        if jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
            x, y = jax.random.key_data(x), jax.random.key_data(y)
        else:
            assert x.sharding.is_equivalent_to(y.sharding, x.ndim), (x.sharding, y.sharding)
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@pytest.mark.parametrize("param_dtype", [None, "bfloat16"])
@pytest.mark.parametrize("dp_size", [3, 8])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_per_leaf_init_is_the_one_program_state(stage, dp_size, param_dtype, monkeypatch):
    """Stages 0-3, with and without a cast to the working dtype, with padding (dp = 3: no
    leaf's size is a multiple of 3), from device and from host (NumPy) params, with model
    state and a key: the per-leaf path builds the one-program path's state exactly, with its
    shardings, compiling one program per kind of leaf plus the optimizer's ``init`` and the
    extras (far fewer than one per leaf)."""
    host = deep_params(32, seed=stage)
    extras = {"model_state": {"count": np.zeros((3,), np.float32)}, "rng": jax.random.key(7)}
    kw = {"config": {"param_dtype": param_dtype}, **extras}
    _, ref, took, _ = build(
        stage, dp_size, False, monkeypatch, jax.tree.map(jnp.asarray, host), **kw
    )
    assert not took
    dp, state, took, n = build(
        stage, dp_size, True, monkeypatch, jax.tree.map(jnp.asarray, host), **dict(kw)
    )
    assert took
    kinds = 2 * (2 if stage or param_dtype else 1)  # kernel and bias; working and master
    assert n <= kinds + 2, n
    assert_same_state(state, ref)
    for x, sh in zip(jax.tree.leaves(state), jax.tree.leaves(dp.state_shardings), strict=True):
        if not jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
            assert x.sharding.is_equivalent_to(sh, x.ndim)
    _, from_host, took, _ = build(stage, dp_size, True, monkeypatch, host, **dict(kw))
    assert took
    assert_same_state(from_host, ref)


def test_one_program_where_leaves_do_not_repeat(monkeypatch):
    """Leaves of many shapes (fewer than ``LEAVES_PER_KIND`` per kind on average) and small
    models (fewer than ``MIN_LEAVES`` leaves) keep the one program: each kind would cost a
    compile of its own."""
    rng = np.random.default_rng(0)
    params = {f"p{i}": rng.standard_normal((4 + i % 20,)).astype(np.float32) for i in range(80)}
    _, _, took, n = build(1, 8, True, monkeypatch, params)
    assert not took and n == 1
    _, _, took, n = build(1, 8, True, monkeypatch, deep_params(state_build.MIN_LEAVES // 2 - 1))
    assert not took and n == 1


def test_abstract_init_keeps_one_program(monkeypatch):
    """Under ``jax.eval_shape`` (``jaxdp.aot.abstract_state``) there is nothing to run: the
    state is traced as one program, with the per-leaf path's shardings."""
    params = deep_params(32)
    dp, state, _, _ = build(1, 8, True, monkeypatch, params)
    fresh = DataParallel(loss_fn, optax.adamw(1e-2), DDPConfig(zero_stage=1), mesh=dp.mesh)
    abstract = jax.eval_shape(fresh.init, params)
    assert jax.tree.map(lambda a: (a.shape, a.dtype), abstract) == jax.tree.map(
        lambda a: (a.shape, a.dtype), jax.eval_shape(lambda: state)
    )
    assert jax.tree.leaves(fresh.state_shardings) == jax.tree.leaves(dp.state_shardings)


@pytest.mark.parametrize("param_dtype", [None, "bfloat16"])
@pytest.mark.parametrize("stage", [0, 1])
def test_per_leaf_init_on_a_tensor_parallel_mesh(stage, param_dtype, monkeypatch):
    """On a data x model mesh each working param keeps its tensor-parallel sharding through
    the per-leaf path (stage 0); where the master view is the plan's tensor-parallel blocks
    (stage 1) ``init`` keeps its one program. Either way the state is the one-program one."""
    from _tp_models import SPECS, place, tp_params

    blocks = 8  # 9 leaves each, 6 kinds of leaf
    devs = np.asarray(jax.devices()[:8]).reshape(4, 2)
    mesh = jax.sharding.Mesh(devs, ("data", "model"))
    params = {f"block_{i}": place(tp_params(seed=i), mesh) for i in range(blocks)}
    kw = {"mesh": mesh, "config": {"param_dtype": param_dtype}}
    _, ref, _, _ = build(stage, None, False, monkeypatch, params, **kw)
    _, state, took, _ = build(stage, None, True, monkeypatch, params, **kw)
    assert took == (stage == 0)
    assert_same_state(state, ref)
    specs = {f"block_{i}": SPECS for i in range(blocks)}
    for x, spec in zip(jax.tree.leaves(state.params), jax.tree.leaves(specs), strict=True):
        assert x.sharding.spec == spec or x.sharding.is_equivalent_to(
            jax.sharding.NamedSharding(mesh, spec), x.ndim
        )


@pytest.mark.parametrize(
    ("stage", "config"),
    [
        (1, {"overlap_param_gather": True}),
        (2, {"overlap_param_gather": True, "param_dtype": "bfloat16"}),
        (3, {"scan_param_patterns": (("^stack/", 0),)}),
        (3, {"scan_param_patterns": (("^stack/", 1),), "param_dtype": "bfloat16"}),
    ],
)
def test_per_leaf_init_of_sharded_params_and_layer_stacks(stage, config, monkeypatch):
    """Working params sharded between steps (``overlap_param_gather``, stage 3) and layer
    stacks laid out per layer (declared by ``scan_param_patterns``, either stacked axis): the
    per-leaf path builds the one-program state."""
    rng = np.random.default_rng(stage)
    host = deep_params(32, seed=stage)
    host["stack"] = {
        "w": rng.standard_normal(
            (5, 13, 11) if config.get("scan_param_patterns") else (13, 11)
        ).astype(np.float32)
    }
    kw = {"config": config}
    _, ref, took, _ = build(stage, 6, False, monkeypatch, host, **dict(kw))
    assert not took
    _, state, took, _ = build(stage, 6, True, monkeypatch, host, **dict(kw))
    assert took
    assert_same_state(state, ref)


def _keeps_params():
    """SGD chained with a transformation whose state holds the params it was initialised
    with: the optimizer state refers to the very arrays ``init`` hands it."""
    hold = optax.GradientTransformation(lambda p: {"p0": p}, lambda g, s, p=None: (g, s))
    return optax.chain(optax.sgd(1e-2), hold)


@pytest.mark.parametrize("layers", [4, 32], ids=["one-program", "per-leaf"])
@pytest.mark.parametrize("stage", [0, 1, 3])
@pytest.mark.parametrize("placed", ["uncommitted", "replicated", "host"])
def test_donated_steps_leave_the_callers_params_alone(stage, layers, placed):
    """The state never shares a buffer with an array the caller holds: after two donated
    steps the params given to ``init`` are all readable and unchanged, whether they were
    uncommitted device arrays (what ``model.init`` returns; jax's ``device_put`` of one to a
    replicated sharding shares its buffer on that device, even with ``may_alias=False``),
    already replicated on the mesh, or NumPy, and also when the optimizer's state holds the
    params themselves."""
    host = deep_params(layers, seed=layers)
    mesh = make_mesh()
    if placed == "host":
        params = host
    elif placed == "replicated":
        rep = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
        params = jax.device_put(host, rep)
    else:
        params = jax.tree.map(jnp.asarray, host)
    dp = DataParallel(loss_fn, _keeps_params(), DDPConfig(zero_stage=stage), mesh=mesh)
    assert dp.donate
    state = dp.init(params)
    batch = dp.shard_batch({"x": np.ones((16, 13), np.float32)})
    for _ in range(2):
        state, _ = dp.step(state, batch)
    jax.block_until_ready(state)
    for x, ref in zip(jax.tree.leaves(params), jax.tree.leaves(host), strict=True):
        assert not getattr(x, "is_deleted", lambda: False)()
        np.testing.assert_array_equal(np.asarray(x), ref)
