"""Print the bucket layout of a small flax MLP for each ZeRO stage and check pack/unpack.

Run: python examples/layout_demo.py
"""

from __future__ import annotations

# jaxdp first: on a machine without a GPU it quiets the CUDA plugin (jaxdp/_platform.py).
import jaxdp  # noqa: F401

# isort: split
import flax.linen as nn
import jax
import jax.numpy as jnp

from jaxdp import BucketLayout, DDPConfig


class MLP(nn.Module):
    width: int = 512
    depth: int = 6

    @nn.compact
    def __call__(self, x):
        for i in range(self.depth):
            x = nn.relu(nn.Dense(self.width, name=f"dense_{i}")(x))
        return nn.Dense(10, name="head")(x)


def main() -> None:
    params = MLP().init(jax.random.key(0), jnp.zeros((1, 512)))["params"]
    for stage in (0, 1):
        cfg = DDPConfig(zero_stage=stage, bucket_size=600_000, grad_reduce_in_fp32=True)
        layout = BucketLayout.from_params(params, cfg, dp_size=8)
        print(layout.summary(), "\n")
        back = layout.unpack(layout.pack(params))
        same = jax.tree.all(jax.tree.map(lambda a, b: bool((a == b).all()), params, back))
        print(f"stage {stage}: unpack(pack(params)) == params: {same}\n")


if __name__ == "__main__":
    main()
