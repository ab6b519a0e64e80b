"""Train a flax MLP classifier with jaxdp on 8 simulated devices (no downloads).

The data is embedded: inputs are random vectors, labels come from a fixed random "teacher"
network, so the student's loss and accuracy show real learning within a few hundred steps.

Run (from any folder):  python examples/train_flax.py [--config FILE.yaml] [--steps 300]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

# The repository's configs/ folder, found from this file, so the example runs from any folder.
CONFIGS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument(
        "--config",
        default=os.path.join(CONFIGS, "zero1_bf16_fp32_reduce.yaml"),
        help="DDPConfig YAML (default: the repository's configs/zero1_bf16_fp32_reduce.yaml)",
    )
    p.add_argument("--steps", type=int, default=300, help="training steps (default: %(default)s)")
    p.add_argument("--batch", type=int, default=256, help="global batch (default: %(default)s)")
    p.add_argument("--lr", type=float, default=3e-3, help="peak AdamW learning rate")
    p.add_argument(
        "--devices",
        type=int,
        default=8,
        help="simulated CPU devices when no accelerator is present (default: 8)",
    )
    return p.parse_args(argv)


ARGS = parse_args()
if "jax" not in sys.modules:  # must happen before jax starts its backend
    flag = f"--xla_force_host_platform_device_count={ARGS.devices}"
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + flag).strip()

# jaxdp first: on a machine without a GPU it quiets the CUDA plugin (jaxdp/_platform.py).
import jaxdp  # noqa: E402

# isort: split
import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn  # noqa: E402

DIM, CLASSES = 64, 10


class MLP(nn.Module):
    width: int = 512
    depth: int = 4

    @nn.compact
    def __call__(self, x):
        for i in range(self.depth):
            x = nn.gelu(nn.Dense(self.width, name=f"dense_{i}")(x))
        return nn.Dense(CLASSES, name="head")(x)


def teacher_data(n: int, seed: int):
    """Random inputs labelled by a fixed random teacher network (the embedded dataset)."""
    kx = jax.random.key(seed)
    teacher = MLP(width=128, depth=2)
    tparams = teacher.init(jax.random.key(1234), jnp.zeros((1, DIM)))
    x = jax.random.normal(kx, (n, DIM))
    y = jnp.argmax(teacher.apply(tparams, x), axis=-1)
    return {"x": x, "y": y.astype(jnp.int32)}


def main() -> None:
    console = Console()
    cfg = jaxdp.DDPConfig.from_yaml(ARGS.config)
    mesh = jaxdp.make_mesh(axis=cfg.data_axis)
    model = MLP()

    def loss_fn(params, batch):
        logits = model.apply({"params": params}, batch["x"].astype(params["head"]["kernel"].dtype))
        loss = optax.softmax_cross_entropy_with_integer_labels(
            logits.astype(jnp.float32), batch["y"]
        )
        acc = jnp.mean(jnp.argmax(logits, -1) == batch["y"])
        return jnp.mean(loss), {"accuracy": acc}

    schedule = optax.warmup_cosine_decay_schedule(0.0, ARGS.lr, ARGS.steps // 10, ARGS.steps)
    params = model.init(jax.random.key(0), jnp.zeros((1, DIM)))["params"]
    not_bias = jax.tree.map(lambda p: p.ndim > 1, params)
    optimizer = optax.adamw(schedule, weight_decay=0.01, mask=not_bias)
    engine = jaxdp.DataParallel(loss_fn, optimizer, cfg, mesh=mesh)

    t0 = time.perf_counter()
    state = engine.init(params)
    n_params = sum(p.size for p in jax.tree.leaves(params))
    console.print(
        f"[bold]jaxdp[/] {jaxdp.__version__}: {n_params:,} params, "
        f"{jax.device_count()} x {jax.devices()[0].platform} devices, config {ARGS.config}"
    )
    console.print(engine.layout.summary())

    data = teacher_data(ARGS.batch * 100, seed=0)
    test = teacher_data(4096, seed=1)
    n_batches = data["x"].shape[0] // ARGS.batch
    history = []
    with Progress(
        TextColumn("[progress.description]{task.description}"),
        BarColumn(),
        TextColumn("{task.completed}/{task.total}"),
        TimeRemainingColumn(),
        console=console,
    ) as progress:
        task = progress.add_task("training", total=ARGS.steps)
        for step in range(ARGS.steps):
            i = step % n_batches
            batch = jax.tree.map(lambda a, i=i: a[i * ARGS.batch : (i + 1) * ARGS.batch], data)
            state, metrics = engine.step(state, engine.shard_batch(batch))
            if step == 0:
                compile_s = time.perf_counter() - t0
            if step % 25 == 0 or step == ARGS.steps - 1:
                loss = float(metrics["loss"])
                history.append(loss)
                progress.update(
                    task,
                    description=(
                        f"loss {loss:.3f} acc {float(metrics['aux']['accuracy']):.2f} "
                        f"|g| {float(metrics['grad_norm']):.2f}"
                    ),
                )
            progress.advance(task)
    elapsed = time.perf_counter() - t0

    final = engine.params(state)
    test_loss, test_aux = loss_fn(final, test)
    console.print(
        f"done: {ARGS.steps} steps in {elapsed:.1f}s (first step incl. compile {compile_s:.1f}s); "
        f"train loss {history[0]:.3f} -> {history[-1]:.3f}; held-out loss {float(test_loss):.3f}, "
        f"accuracy {float(test_aux['accuracy']):.3f} (chance {1 / CLASSES:.2f})"
    )
    if not history[-1] < history[0]:
        raise SystemExit("training did not reduce the loss")


if __name__ == "__main__":
    main()
