"""Dense layers whose weight gradient can be fused into the engine's fp32 accumulator.

``Dense``/``DenseGeneral`` subclass ``flax.linen.Dense``/``DenseGeneral`` and ``Linear``
subclasses ``flax.nnx.Linear``: same constructor arguments, parameter names, shapes and
initialisation. Outside a fused trace (see :mod:`jaxdp._src.core.fusion`) they run flax's own
``__call__``. Inside one, a layer whose kernel the engine made fp32 multiplies with
:func:`~jaxdp.nn.fused_matmul` in the dtype flax would have computed in (the kernel's working
dtype stands in for the fp32 primal in flax's dtype promotion), so the forward is unchanged and
only the weight gradient's precision differs. A custom ``dot_general``/``dot_general_cls``, nnx's
``preferred_element_type`` or ``DenseGeneral(batch_dims=...)`` keep the unfused path.
"""

from __future__ import annotations

from typing import Any

import flax.linen as linen
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax import lax

from .._src.core.fusion import SCOPE, fused_matmul, fusion_dtype

__all__ = ["Dense", "DenseGeneral", "Linear"]


def _module_path(module: linen.Module) -> tuple[str, ...]:
    return tuple(module.scope.path) if module.scope is not None else ()


def _bias_shape(y: jax.Array, bias: jax.Array, n_features: int) -> jax.Array:
    return jnp.reshape(bias, (1,) * (y.ndim - n_features) + bias.shape)


class Dense(linen.Dense):
    """``flax.linen.Dense`` whose weight gradient can be fused (``gradient_accumulation_fusion``).

    Same attributes as ``flax.linen.Dense``; see :mod:`jaxdp._src.core.fusion` for the mechanism.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> import flax.linen
        >>> from jaxdp import nn
        >>> x = jnp.ones((2, 4))
        >>> p = nn.Dense(3).init(jax.random.key(0), x)
        >>> ref = flax.linen.Dense(3).init(jax.random.key(0), x)
        >>> bool(jnp.array_equal(nn.Dense(3).apply(p, x), flax.linen.Dense(3).apply(ref, x)))
        True
    """

    @linen.compact
    def __call__(self, inputs: Any) -> jax.Array:
        if SCOPE.get() is None or self.dot_general is not None or self.dot_general_cls is not None:
            return super().__call__(inputs)
        kernel: Any = self.param(
            "kernel", self.kernel_init, (jnp.shape(inputs)[-1], self.features), self.param_dtype
        )
        bias: Any = (
            self.param("bias", self.bias_init, (self.features,), self.param_dtype)
            if self.use_bias
            else None
        )
        work = fusion_dtype(kernel, _module_path(self))
        if work is None:  # flax's computation, verbatim
            inputs, kernel, bias = self.promote_dtype(inputs, kernel, bias, dtype=self.dtype)
            y = lax.dot_general(
                inputs, kernel, (((inputs.ndim - 1,), (0,)), ((), ())), precision=self.precision
            )
        else:
            inputs, _, bias = self.promote_dtype(
                inputs, kernel.astype(work), bias, dtype=self.dtype
            )
            y = fused_matmul(inputs, kernel, self.precision)
        if bias is not None:
            y += _bias_shape(y, bias, 1)
        return y


class DenseGeneral(linen.DenseGeneral):
    """``flax.linen.DenseGeneral`` whose weight gradient can be fused.

    Same attributes as ``flax.linen.DenseGeneral``; with ``batch_dims`` it never fuses.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> from jaxdp import nn
        >>> layer = nn.DenseGeneral(features=(2, 3), axis=-1)
        >>> p = layer.init(jax.random.key(0), jnp.ones((5, 4)))
        >>> p["params"]["kernel"].shape, layer.apply(p, jnp.ones((5, 4))).shape
        ((4, 2, 3), (5, 2, 3))
    """

    @linen.compact
    def __call__(self, inputs: Any) -> jax.Array:
        if (
            SCOPE.get() is None
            or self.batch_dims
            or self.dot_general is not None
            or self.dot_general_cls is not None
        ):
            return super().__call__(inputs)
        features = linen.linear._canonicalize_tuple(self.features)
        axis = linen.linear._normalize_axes(
            linen.linear._canonicalize_tuple(self.axis), inputs.ndim
        )
        n_axis = len(axis)
        kernel_shape = tuple(inputs.shape[a] for a in axis) + features
        k_in = int(np.prod(kernel_shape[:n_axis]))
        k_out = int(np.prod(features))

        def flat_init(init: Any, shape: tuple[int, ...], flat: tuple[int, ...]) -> Any:
            # flax initialises the flattened matrix and reshapes (fan-in/out of the 2-D view).
            def wrapped(rng: Any, shape: Any = shape, dtype: Any = jnp.float32) -> Any:
                value = init(rng, flat, dtype)
                if isinstance(value, linen.meta.AxisMetadata):
                    return linen.meta.replace_boxed(value, jnp.reshape(value.unbox(), shape))
                return jnp.reshape(value, shape)

            return wrapped

        kernel: Any = self.param(
            "kernel",
            flat_init(self.kernel_init, kernel_shape, (k_in, k_out)),
            kernel_shape,
            self.param_dtype,
        )
        bias: Any = (
            self.param(
                "bias", flat_init(self.bias_init, features, (k_out,)), features, self.param_dtype
            )
            if self.use_bias
            else None
        )
        contract = tuple(range(n_axis))
        work = fusion_dtype(kernel, _module_path(self))
        if work is None:
            inputs, kernel, bias = self.promote_dtype(inputs, kernel, bias, dtype=self.dtype)
            y = lax.dot_general(
                inputs, kernel, ((axis, contract), ((), ())), precision=self.precision
            )
        else:
            inputs, _, bias = self.promote_dtype(
                inputs, kernel.astype(work), bias, dtype=self.dtype
            )
            rest = [d for d in range(inputs.ndim) if d not in axis]
            x = jnp.transpose(inputs, (*rest, *axis))
            lead = x.shape[: len(rest)]
            y = fused_matmul(x.reshape(*lead, k_in), kernel.reshape(k_in, k_out), self.precision)
            y = y.reshape(*lead, *features)
        if bias is not None:
            y += _bias_shape(y, bias, len(features))
        return y


class Linear(nnx.Linear):
    """``flax.nnx.Linear`` whose weight gradient can be fused.

    Same constructor as ``flax.nnx.Linear``. Recognised by the identity of its kernel array, so
    it fuses when called directly on the params the engine hands ``loss_fn`` (after
    ``nnx.merge``); inside ``nnx.scan``/``nnx.vmap`` it keeps the unfused path.

    Example:
        >>> import jax.numpy as jnp
        >>> from flax import nnx
        >>> from jaxdp import nn
        >>> layer = nn.Linear(4, 3, rngs=nnx.Rngs(0))
        >>> ref = nnx.Linear(4, 3, rngs=nnx.Rngs(0))
        >>> bool(jnp.array_equal(layer(jnp.ones((2, 4))), ref(jnp.ones((2, 4)))))
        True
    """

    def __call__(self, inputs: jax.Array, out_sharding: Any = None) -> jax.Array:
        if (
            SCOPE.get() is None
            or self.dot_general is not lax.dot_general
            or self.preferred_element_type is not None
            or out_sharding is not None
        ):
            return super().__call__(inputs, out_sharding)
        kernel = self.kernel.get_value()
        work = fusion_dtype(kernel)
        if work is None:
            return super().__call__(inputs, out_sharding)
        bias = self.bias.get_value() if self.bias is not None else None
        inputs, _, bias = self.promote_dtype((inputs, kernel.astype(work), bias), dtype=self.dtype)
        y = fused_matmul(inputs, kernel, self.precision)
        if bias is not None:
            y += _bias_shape(y, bias, 1)
        return y
