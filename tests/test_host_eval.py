"""``jaxdp._src.optim.host_eval``: a jaxpr evaluated with NumPy gives what jax gives (to a few
units of
roundoff), in jax's dtypes, for every primitive it runs itself and for the ones it hands back to
jax; and the optimizer probe built on it compiles nothing."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _models import counting_compiles
from jax import lax

from jaxdp._src.config.config import DDPConfig
from jaxdp._src.layout.layout import BucketLayout
from jaxdp._src.optim.check import _numeric_check, _steps, check_optimizer
from jaxdp._src.optim.host_eval import evaluate

RNG = np.random.default_rng(0)
X = RNG.standard_normal((5, 7)).astype(np.float32)
Y = RNG.standard_normal((5, 7)).astype(np.float32)
POS = np.abs(X) + 0.5
INTS = np.array([-7, -3, 0, 4, 9], np.int32)
JNTS = np.array([2, -2, 3, -4, 5], np.int32)


def _relu_sq(x):
    return jax.nn.relu(x) ** 2  # custom_jvp inside


@jax.custom_vjp
def _clip_grad(x):
    return x


_clip_grad.defvjp(lambda x: (x, None), lambda _, g: (jnp.clip(g, -1, 1),))

CASES = {
    "arithmetic": (lambda x, y: (x + y) * y - x / (y + 3.0) + jnp.maximum(x, y), (X, Y)),
    "unary": (
        lambda x, p: (
            jnp.sqrt(p) + lax.rsqrt(p) + jnp.exp(-p) + jnp.log(p) + jnp.log1p(p) + jnp.expm1(x),
            jnp.tanh(x) + jax.nn.sigmoid(x) + jnp.sin(x) * jnp.cos(x) + jnp.abs(x) * jnp.sign(x),
            jnp.floor(x) + jnp.ceil(x) + jnp.square(x) + x**3 + p**-2 + p**1.5,
            jnp.isfinite(x / 0.0),
        ),
        (X, POS),
    ),
    "compare_select": (
        lambda x, y: (
            jnp.where(x > y, x, y),
            jnp.where((x <= y) & ~(x == y) | (x != 0) ^ (y >= 0), 1.0, 2.0),
            lax.select_n((x > 0).astype(jnp.int32) + (y > 0), x, y, x * y),
            jnp.clip(x, -0.5, 0.5),
        ),
        (X, Y),
    ),
    "integers": (
        lambda i, j: (lax.div(i, j), lax.rem(i, j), i & j, i | j, i ^ j, ~i, i * j - 3),
        (INTS, JNTS),
    ),
    "shapes": (
        lambda x: (
            x.T.reshape(7, 5)[None, :, :1].squeeze((0, 2)),
            jnp.broadcast_to(x[:, None, :], (5, 3, 7)),
            jnp.transpose(x[:, :, None], (2, 1, 0)),
        ),
        (X,),
    ),
    "reductions": (
        lambda x: (x.sum(), x.sum(0), x.max(1), x.min(), jnp.prod(x[:2, :3]), jnp.all(x > -9)),
        (X,),
    ),
    "dot_general": (
        lambda x, y: (
            jnp.vdot(x, y),
            x @ y.T,
            jnp.einsum("ij,kj->ik", x, y),
            lax.dot_general(x.reshape(5, 7, 1), y.reshape(5, 1, 7), (((2,), (1,)), ((0,), (0,)))),
        ),
        (X, Y),
    ),
    "dtypes": (
        lambda x: (
            x.astype(jnp.bfloat16) * 3,
            x.astype(jnp.bfloat16).astype(jnp.float32).sum(),  # (no f16: SSE4.2 XLA lacks it)
            (x * 100).astype(jnp.int32),
            jnp.float32(2.0) ** jnp.arange(5),
        ),
        (X,),
    ),
    "calls_and_control_flow": (
        lambda x: (
            jax.jit(lambda a: a * 2 + 1)(x),
            _relu_sq(x),
            jax.grad(lambda a: _clip_grad(a * 5).sum())(x),
            lax.cond(x.sum() > 0, lambda a: a + 1, lambda a: a - 1, x),
            lax.switch(7, [lambda a: a, lambda a: -a, lambda a: a * 2], x),
            lax.fori_loop(0, 4, lambda k, a: a * 0.5 + k, x),
            lax.while_loop(lambda c: c[0] < 3, lambda c: (c[0] + 1, c[1] * 2), (0, x))[1],
        ),
        (X,),
    ),
    "handed_to_jax": (  # random bits, cumsum, sort: not in NumPy's table, bound through jax
        lambda x: (
            x + jax.random.normal(jax.random.key(0), x.shape),
            jnp.cumsum(x, axis=1),
            jnp.sort(x, axis=0),
            # 70 cases: NumPy's choose takes at most 64 (32 before NumPy 2), so jax runs it
            lax.select_n(
                (jnp.arange(35, dtype=jnp.int32).reshape(5, 7) * 3) % 70,
                *[x * k for k in range(70)],
            ),
        ),
        (X,),
    ),
}


@pytest.mark.parametrize("name", list(CASES))
def test_evaluate_matches_jax(name):
    fn, args = CASES[name]
    closed = jax.make_jaxpr(fn)(*args)
    got = evaluate(closed, args)
    want = jax.tree.leaves(fn(*(jnp.asarray(a) for a in args)))
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        w = np.asarray(w)
        assert isinstance(g, np.ndarray)
        assert g.shape == w.shape and g.dtype == w.dtype, (name, g.shape, g.dtype, w.dtype)
        if np.issubdtype(w.dtype, np.inexact):
            # A few units of roundoff of the result's dtype, relative to the operands' scale
            # (summation order and libm differ between NumPy and XLA; values are O(1) here).
            eps = float(jnp.finfo(w.dtype).eps)
            scale = max(1.0, float(np.max(np.abs(w.astype(np.float64)), initial=0.0)))
            np.testing.assert_allclose(
                g.astype(np.float64), w.astype(np.float64), rtol=0, atol=16 * eps * scale
            )
        else:
            np.testing.assert_array_equal(g, w)


def test_evaluate_keeps_prng_keys_as_jax_arrays():
    closed = jax.make_jaxpr(lambda s: jax.random.split(jax.random.key(s)))(0)
    (keys,) = evaluate(closed, [np.int32(3)])
    assert jax.dtypes.issubdtype(keys.dtype, jax.dtypes.prng_key)
    (again,) = evaluate(jax.make_jaxpr(lambda k: jax.random.split(k[0]))(keys), [keys])
    assert again.shape == (2,)


def test_evaluate_is_silent_on_inf_and_nan():
    closed = jax.make_jaxpr(lambda x: (x / 0.0, jnp.log(-x)))(X)
    with np.errstate(all="raise"):
        inf, nan = evaluate(closed, [np.abs(X) + 1])
    assert np.all(np.isinf(inf)) and np.all(np.isnan(nan))


def _layout(params, dp=3):
    return BucketLayout.from_params(params, DDPConfig(zero_stage=1), dp)


def test_probe_compiles_nothing():
    """The probe of an ordinary optimizer runs no XLA compile: in a fresh process, compiling
    each op of three eager AdamW steps cost about 1 s for 10 parameters. (``check_optimizer``
    does not probe these known optimizers at all; the probe itself is called here.)"""
    params = {f"l{i}": {"w": jnp.ones((4, 6)), "b": jnp.ones((6,))} for i in range(5)}
    with counting_compiles() as compiles:
        for opt in (
            optax.adamw(1e-2),
            optax.chain(optax.clip_by_global_norm(1.0), optax.lion(1e-3)),
            optax.lamb(1e-2),
        ):
            _numeric_check(opt, _layout(params))
    assert compiles == []


def test_steps_match_eager_steps():
    """Three optimizer steps evaluated on the host equal the same steps run by jax."""
    params = {"w": X, "b": Y[0], "s": np.float32(0.3)}
    grads = [jax.tree.map(lambda x, k=k: np.asarray(x) * (k + 1) - 0.5, params) for k in range(3)]
    for opt in (
        optax.adamw(1e-2),
        optax.MultiSteps(optax.adam(1e-2), 2),
        optax.inject_hyperparams(optax.sgd)(learning_rate=optax.cosine_decay_schedule(0.1, 9)),
        optax.contrib.prodigy(1.0),
        optax.noisy_sgd(1e-2, key=jax.random.key(1)),
    ):
        host = _steps(opt, params, grads)
        p, s = params, opt.init(params)
        for g in grads:
            u, s = opt.update(g, s, p)
            p = optax.apply_updates(p, u)
        for k in params:
            change = np.max(np.abs(np.asarray(p[k]) - params[k]))
            np.testing.assert_allclose(host[k], p[k], rtol=0, atol=1e-5 * change + 1e-7)


class _Branchy:
    """An elementwise SGD that branches in Python on a value (cannot be traced)."""

    def init(self, params):
        return ()

    def update(self, grads, state, params=None):
        scale = 0.1 if float(jnp.sum(jax.tree.leaves(grads)[0])) > -1e9 else 0.2
        return jax.tree.map(lambda g: -scale * g, grads), state


def test_untraceable_optimizer_is_probed_eagerly():
    params = {"w": X, "b": Y[0]}
    grads = [params] * 3
    out = _steps(_Branchy(), params, grads)
    np.testing.assert_allclose(out["w"], X * (1 - 3 * 0.1), rtol=1e-6)
    check_optimizer(_Branchy(), _layout(params))  # elementwise: accepted
