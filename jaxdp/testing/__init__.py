"""``jaxdp.testing``: helpers for numerical tests of models trained with jaxdp (chex-based).

* :class:`Reference`: a single-device reference of :class:`jaxdp.DataParallel`'s step (same
  optimizer, micro-batching, model state, PRNG keys and gradient averaging), for ``dp``
  simulated ranks;
* :func:`assert_matches_reference`: an engine's params and model state match the reference's
  to a tolerance derived from the dtype (:func:`tolerance`), or, with ``batch=``, the next
  step's gradient matches the reference's at the engine's own params
  (:meth:`Reference.restart`; for models with kinks over several steps);
  :func:`assert_trees_close`;
* :func:`reduced_gradient`: the reduced gradient of one engine step, at any ZeRO stage;
* the bf16 ring simulator: :func:`bf16_ring_reduce_scatter`, :func:`round_to_bf16`,
  :func:`bf16_rounding_report`.

Example (a user's test of their model):
    >>> import jax, jax.numpy as jnp, optax
    >>> from jaxdp import DataParallel, DDPConfig
    >>> from jaxdp.testing import Reference, assert_matches_reference
    >>> def loss_fn(p, b, *, rng):
    ...     keep = jax.random.bernoulli(rng, 0.9, b["x"].shape)  # dropout on the inputs
    ...     return jnp.mean((jnp.where(keep, b["x"], 0.0) @ p["w"]) ** 2)
    >>> cfg = DDPConfig(zero_stage=3, num_microbatches=2)
    >>> dp = DataParallel(loss_fn, optax.adam(1e-2), cfg)
    >>> ref = Reference(loss_fn, optax.adam(1e-2), cfg, dp=dp.dp)
    >>> params, key = {"w": jnp.linspace(-1.0, 1.0, 12).reshape(4, 3)}, jax.random.key(0)
    >>> state, ref_state = dp.init(params, rng=key), ref.init(params, rng=key)
    >>> batch = {"x": jnp.ones((32, 4))}
    >>> for _ in range(2):
    ...     state, _ = dp.step(state, dp.shard_batch(batch))
    ...     ref_state, _ = ref.step(ref_state, batch)
    >>> assert_matches_reference(dp, state, ref, ref_state)
"""

from ._assert import assert_matches_reference as assert_matches_reference
from ._assert import assert_trees_close as assert_trees_close
from ._assert import reduced_gradient as reduced_gradient
from ._assert import tolerance as tolerance
from ._bf16 import bf16_ring_reduce_scatter as bf16_ring_reduce_scatter
from ._bf16 import bf16_rounding_report as bf16_rounding_report
from ._bf16 import bf16_ulp as bf16_ulp
from ._bf16 import round_to_bf16 as round_to_bf16
from ._reference import Reference as Reference
from ._reference import ReferenceState as ReferenceState

__all__ = [
    "Reference",
    "ReferenceState",
    "assert_matches_reference",
    "assert_trees_close",
    "bf16_ring_reduce_scatter",
    "bf16_rounding_report",
    "bf16_ulp",
    "reduced_gradient",
    "round_to_bf16",
    "tolerance",
]
