"""Optimizers recognised as elementwise without the numeric probe (``jaxdp._src.optim.known``).

Recognition must never accept what the probe would refuse: every optimizer it knows is also
run through the probe here, on layouts that need padding (dp 3 and 8, a scalar and a 3-D
parameter)."""

import jax
import jax.numpy as jnp
import optax
import pytest

import jaxdp._src.optim.check as optim_check
from jaxdp import DDPConfig
from jaxdp._src.layout.layout import BucketLayout
from jaxdp._src.optim.known import known_elementwise

PARAMS = {
    "dense": {"w": jnp.ones((5, 7)), "b": jnp.ones((7,))},
    "conv": jnp.ones((3, 3, 2, 4)),
    "scale": jnp.asarray(0.5),
}
TREEDEF = jax.tree.structure(PARAMS)
NOT_BIAS = jax.tree.map(lambda x: x.ndim > 1, PARAMS)

KNOWN = {
    "sgd": lambda: optax.sgd(0.1),
    "momentum": lambda: optax.sgd(0.1, momentum=0.9, nesterov=True),
    "adam": lambda: optax.adam(1e-2),
    "adam bf16 moments": lambda: optax.adam(1e-2, mu_dtype=jnp.bfloat16),
    "adamw": lambda: optax.adamw(1e-3, weight_decay=0.1),
    "adamw schedule + pytree mask": lambda: optax.adamw(
        optax.warmup_cosine_decay_schedule(0.0, 1e-2, 2, 10), weight_decay=0.1, mask=NOT_BIAS
    ),
    "adam, own schedule": lambda: optax.adam(lambda count: 1e-3 / (1 + count)),
    "adam, joined schedules": lambda: optax.adam(
        optax.join_schedules(
            [optax.constant_schedule(1e-3), optax.linear_schedule(1e-3, 0.0, 10)], [5]
        )
    ),
    "adam, array learning rate": lambda: optax.adam(jnp.asarray(1e-3)),
    "lion": lambda: optax.lion(1e-3, weight_decay=0.01),
    "lamb": lambda: optax.lamb(1e-2),
    "rmsprop": lambda: optax.rmsprop(1e-3),
    "adabelief": lambda: optax.adabelief(1e-3),
    "amsgrad": lambda: optax.amsgrad(1e-3),
    "clip + adam": lambda: optax.chain(optax.clip_by_global_norm(0.1), optax.adam(1e-2)),
    "clip elementwise + sgd": lambda: optax.chain(optax.clip(0.01), optax.sgd(0.1)),
    "weight decay from a schedule": lambda: optax.chain(
        optax.add_decayed_weights(optax.linear_schedule(0.1, 0.0, 10)), optax.sgd(0.1)
    ),
    "masked decay + adam": lambda: optax.chain(
        optax.masked(optax.add_decayed_weights(0.1), NOT_BIAS), optax.adam(1e-2)
    ),
}

UNKNOWN = {
    # shape-dependent: the probe refuses these
    "mask computed from ndim": lambda: optax.adamw(
        1e-2, mask=lambda p: jax.tree.map(lambda x: x.ndim > 1, p)
    ),
    "adafactor": lambda: optax.adafactor(1e-2),
    # not listed, so probed (and accepted by the probe where elementwise)
    "multi_transform": lambda: optax.multi_transform(
        {"w": optax.adam(1e-2), "b": optax.sgd(0.05)},
        jax.tree.map(lambda x: "w" if x.ndim > 1 else "b", PARAMS),
    ),
    "inject_hyperparams": lambda: optax.inject_hyperparams(optax.adamw)(learning_rate=1e-3),
    "inject_hyperparams of a known transformation": lambda: optax.inject_hyperparams(
        optax.scale_by_adam
    )(b1=0.9),
    "MultiSteps": lambda: optax.MultiSteps(optax.adam(1e-3), 2),
    "adagrad": lambda: optax.adagrad(1e-2),
    "mask of another tree": lambda: optax.adamw(1e-3, mask={"other": True}),
    "a weight decay per element": lambda: optax.chain(
        optax.add_decayed_weights(jnp.full((7,), 0.1)), optax.sgd(0.1)
    ),
    "own transformation": lambda: optax.GradientTransformation(
        lambda p: (), lambda g, s, p=None: (jax.tree.map(lambda x: -0.1 * x, g), s)
    ),
}


def _layout(dp, layout="interleaved"):
    return BucketLayout.from_params(PARAMS, DDPConfig(zero_stage=1, bucket_layout=layout), dp)


@pytest.mark.parametrize("name", list(KNOWN))
def test_known_optimizers_are_recognised_and_pass_the_probe(name):
    opt = KNOWN[name]()
    assert known_elementwise(opt, TREEDEF)
    for dp in (3, 8):
        layout = _layout(dp)
        optim_check._structure_check(opt, layout, jnp.float32)
        optim_check._numeric_check(opt, layout)


@pytest.mark.parametrize("name", list(UNKNOWN))
def test_other_optimizers_are_left_to_the_probe(name):
    assert not known_elementwise(UNKNOWN[name](), TREEDEF)


def test_a_pytree_mask_needs_the_params_structure():
    assert not known_elementwise(optax.adamw(1e-3, mask=NOT_BIAS), None)


def test_check_optimizer_probes_only_what_it_does_not_know(monkeypatch):
    calls = []
    monkeypatch.setattr(optim_check, "_numeric_check", lambda *a: calls.append(a[0]))
    known, unknown = optax.adamw(1e-3), optax.adagrad(1e-2)
    optim_check.check_optimizer(known, _layout(3))
    assert calls == []
    optim_check.check_optimizer(unknown, _layout(3))
    assert calls == [unknown]
    # the Megatron layout hands the optimizer per-bucket shards: always probed
    optim_check.check_optimizer(known, _layout(3, "megatron"))
    assert calls == [unknown, known]


def test_refusals_are_unchanged():
    bad = UNKNOWN["mask computed from ndim"]()
    with pytest.raises(ValueError, match="updates parameter"):
        optim_check.check_optimizer(bad, _layout(3))
