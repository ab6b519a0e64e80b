"""One contract, every ZeRO strategy: what the plan builds behaves as the interface promises.

For each row (stage, layout, mesh kind, stacks, overlap) the strategy must: build a state whose
shardings are the ones it names; export and rebuild the params it was given; convert its state
to the canonical (params-shaped) form and back without changing a bit; hand the optimizer
gradients in the form of its master weights; and report its collectives and traffic.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _models import make_batch, mlp_params, mse_loss, scan_mlp_loss, scan_mlp_params
from _tp_models import place, tp_batch, tp_loss, tp_params

from jaxdp import DataParallel, DDPConfig
from jaxdp._src.strategy.strategy import Replicated, ShardedOpt, ShardedParams


def _tp_mesh():
    return jax.sharding.Mesh(np.asarray(jax.devices()).reshape(4, 2), ("data", "model"))


# (id, strategy class, config, model): every strategy on every state form the plan can pick.
ROWS = [
    ("stage0", Replicated, {"zero_stage": 0}, "mlp"),
    ("stage0-bf16", Replicated, {"zero_stage": 0, "param_dtype": "bfloat16"}, "mlp"),
    ("stage1", ShardedOpt, {"zero_stage": 1}, "mlp"),
    ("stage1-megatron", ShardedOpt, {"zero_stage": 1, "bucket_layout": "megatron"}, "mlp"),
    ("stage1-overlap", ShardedOpt, {"zero_stage": 1, "overlap_param_gather": True}, "mlp"),
    ("stage2-g2", ShardedOpt, {"zero_stage": 2, "num_microbatches": 2}, "mlp"),
    (
        "stage1-a2a",
        ShardedOpt,
        {"zero_stage": 1, "reduce_scatter_with_fp32_accumulation": True},
        "mlp",
    ),
    ("stage3", ShardedParams, {"zero_stage": 3, "param_dtype": "bfloat16"}, "mlp"),
    ("stage3-megatron", ShardedParams, {"zero_stage": 3, "bucket_layout": "megatron"}, "mlp"),
    ("stage3-stacks", ShardedParams, {"zero_stage": 3}, "scan"),
    ("tp-stage0", Replicated, {"zero_stage": 0}, "tp"),
    ("tp-stage1", ShardedOpt, {"zero_stage": 1}, "tp"),
    ("tp-stage3", ShardedParams, {"zero_stage": 3, "num_microbatches": 2}, "tp"),
]


def _setup(cfg, model):
    config = DDPConfig(bucket_size=200, **cfg)
    opt = optax.adamw(1e-2)
    if model == "tp":
        mesh = _tp_mesh()
        dp = DataParallel(tp_loss, opt, config, mesh=mesh)
        params, batch = place(tp_params(), mesh), tp_batch(16)
        return dp, dp.init(params), tp_params(), batch
    if model == "scan":
        params = scan_mlp_params()
        batch = {"x": jnp.ones((16, 6)), "y": jnp.ones((16, 4))}
        dp = DataParallel(scan_mlp_loss, opt, config)
        return dp, dp.init(params, example_batch=batch), params, batch
    params = mlp_params()
    dp = DataParallel(mse_loss, opt, config)
    return dp, dp.init(params), params, make_batch(16)


def _equal(a, b):
    jax.tree.map(np.testing.assert_array_equal, a, b)


@pytest.mark.parametrize(("cls", "cfg", "model"), [r[1:] for r in ROWS], ids=[r[0] for r in ROWS])
def test_strategy_contract(cls, cfg, model):
    dp, state, params, batch = _setup(cfg, model)
    s = dp.plan.strategy
    assert type(s) is cls and s.name
    if model == "scan":
        assert dp.layout.stacked  # the plan found the layer stack and gathers it per layer
    # The state's shardings are the ones the strategy names.
    for x, sh in zip(jax.tree.leaves(state), jax.tree.leaves(s.state_shardings(state))):
        assert x.sharding.is_equivalent_to(sh, x.ndim), (x.shape, x.sharding, sh)
    # Export gives the params back, in their own dtypes.
    _equal(dp.params(state), params)
    # Canonical form: params-shaped; back again bit for bit.
    c_params, c_master, c_opt = jax.jit(s.to_canonical)(state)
    full = jax.tree.map(lambda x: x.shape, s.full_params())
    assert jax.tree.map(lambda x: x.shape, c_params) == full
    if c_master is not None:
        _equal(c_master, params)
    back = jax.jit(s.from_canonical)(state.step, c_params, c_master, c_opt)
    _equal(back, state)
    # Rebuilding the working params from the master weights reproduces them.
    rebuilt, _ = jax.jit(s.rebuild)(s.target(state), state.params, jnp.zeros(()))
    _equal(rebuilt, state.params)
    # The gradients the step hands the optimizer have the master weights' form.
    grads, metrics, _ = jax.jit(lambda p, b: s.local_step(dp.loss_fn, p, b))(
        state.params, dp.shard_batch(batch)
    )
    target = s.target(state)
    assert jax.tree.structure(grads) == jax.tree.structure(target)
    for gr, t in zip(jax.tree.leaves(grads), jax.tree.leaves(target), strict=True):
        assert gr.shape == t.shape and gr.sharding.is_equivalent_to(t.sharding, t.ndim)
    assert float(metrics["grad_norm"]) > 0
    # Reports.
    assert set(s.grad_collectives) <= {"all-reduce", "reduce-scatter", "all-to-all"}
    assert isinstance(s.bytes_per_step(), int) and s.bytes_per_step() > 0
    # Per-parameter collectives (XLA combines them): stage 3 and stages 1-2 on the interleaved
    # layout, unless an all_to_all mode sums explicit buckets.
    a2a = dp.config.reduce_scatter_with_fp32_accumulation or dp.config.deterministic_reduction
    assert s.gathers_per_parameter == (
        cls is not Replicated
        and dp.layout.kind == "interleaved"
        and not dp.layout.stacked
        and (cls is ShardedParams or not (a2a or model == "tp"))
    )
    # Stage 0 all-reduces per parameter too, with a psum on the wire and params whole here.
    assert s.reduces_per_parameter == (
        s.gathers_per_parameter
        or (cls is Replicated and not a2a and model != "tp" and not dp.layout.stacked)
    )


def test_unsupported_combinations_are_one_table():
    from jaxdp._src.strategy.plan import UNSUPPORTED, check_supported

    assert len(UNSUPPORTED) == 2
    with pytest.raises(NotImplementedError, match="expert_axis='expert' with zero_stage=3"):
        check_supported(DDPConfig(zero_stage=3, expert_axis="expert"))


def _owner_by_scan(key_paths, shapes, path, shape):
    """The definition :class:`jaxdp._src.forms.codec.Owners` indexes: the first parameter whose key
    path ends the leaf's and whose shape is the leaf's."""
    for i, (kp, want) in enumerate(zip(key_paths, shapes, strict=True)):
        if kp and tuple(path)[-len(kp) :] == tuple(kp) and tuple(shape) == tuple(want):
            return i
    return None


@pytest.mark.parametrize(
    "opt",
    [
        optax.adamw(1e-3),
        optax.chain(optax.clip_by_global_norm(1.0), optax.lamb(1e-3)),
        optax.multi_transform(
            {"a": optax.adam(1e-3), "b": optax.sgd(1e-2, momentum=0.9)},
            {"enc": {"w": "a", "b": "b"}, "dec": {"w": "a", "b": "b"}, "t": "b", "x": "a"},
        ),
    ],
    ids=["adamw", "clip+lamb", "multi_transform"],
)
def test_owners_index_matches_the_scan(opt):
    """Optimizer-state leaves find their parameter by key-path suffix and shape through an
    index built once; it must pick what a scan over every parameter picks, with repeated leaf
    names ("w", "b" under two parents), equal shapes, a scalar and a top-level leaf."""
    from jaxdp._src.forms.codec import Owners

    params = {
        "enc": {"w": jnp.ones((4, 3)), "b": jnp.ones((3,))},
        "dec": {"w": jnp.ones((4, 3)), "b": jnp.ones((3,))},
        "t": jnp.ones(()),
        "x": jnp.ones((3,)),
    }
    leaves = jax.tree_util.tree_flatten_with_path(params)[0]
    key_paths = [tuple(kp) for kp, _ in leaves]
    shapes = [x.shape for _, x in leaves]
    owners = Owners(key_paths, shapes)
    found = 0
    for path, x in jax.tree_util.tree_flatten_with_path(opt.init(params))[0]:
        want = _owner_by_scan(key_paths, shapes, path, x.shape)
        assert owners(path, x.shape) == want, jax.tree_util.keystr(path)
        found += want is not None
    assert found >= len(key_paths)  # every parameter owns at least one state leaf
    # one array as the whole params: its key path is empty and ends no leaf's path
    assert Owners([()], [(3,)])((), (3,)) is None
