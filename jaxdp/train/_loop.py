"""The main job's training loop: GPT + DataParallel + checkpoints + logs."""

from __future__ import annotations

import argparse
import functools
import json
import os
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.experimental import multihost_utils
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from .. import CheckpointManager, DataParallel, make_mesh, microbatches
from ..launch._progress import Progress as StepReports
from ..models.gpt import GPT, generate, next_byte_loss
from ._data import batch_rows, load_corpus
from ._mfu import mfu, train_flops_per_token
from ._options import RunConfig
from ._profile import StepProfiler
from ._report import MetricsLog, plot_loss, print_summary
from ._rundir import UsageError, clear_run
from ._stop import StopAgreement, StopSignals, signal_name

__all__ = ["Trainer"]

_EVAL_SEED_OFFSET = 1_000_003


def make_optimizer(cfg: RunConfig, params: Any) -> optax.GradientTransformation:
    t = cfg.train
    schedule = optax.warmup_cosine_decay_schedule(
        0.0, t.lr, max(t.warmup, 1), max(t.decay_steps, t.warmup + 1), t.lr * t.min_lr_ratio
    )
    matrices = jax.tree.map(lambda p: p.ndim >= 2, params)
    return optax.adamw(schedule, b1=0.9, b2=0.95, weight_decay=t.weight_decay, mask=matrices)


class Trainer:
    """Everything that can fail on bad input is done in ``__init__`` (before any file in OUT
    changes); :meth:`run` trains."""

    def __init__(
        self,
        cfg: RunConfig,
        args: argparse.Namespace,
        signals: StopSignals | None = None,
        progress: StepReports | None = None,
    ):
        self.cfg, self.args = cfg, args
        # where the loop is, for the hang watchdogs (jaxdp.launch's or the in-process one)
        self.progress = progress if progress is not None else StepReports()
        self.signals = signals if signals is not None else StopSignals()
        self.lead = jax.process_index() == 0
        self.console = Console(quiet=not self.lead)
        devices = jax.devices()
        if args.devices and jax.process_count() == 1:
            if args.devices > len(devices):
                raise UsageError(
                    f"--devices {args.devices}: only {len(devices)} "
                    f"{devices[0].platform} devices exist. Fix: --devices {len(devices)} or "
                    "fewer."
                )
            devices = devices[: args.devices]
        ax = cfg.ddp.data_axis  # a two-level data_axis: the engine groups the devices itself
        self.mesh = make_mesh(devices, axis=ax) if isinstance(ax, str) else devices
        dp = len(devices)
        t = cfg.train
        try:
            g = microbatches(t.global_batch, t.micro_batch, dp)
        except (TypeError, ValueError) as e:
            raise UsageError(f"--global-batch/--micro-batch with {dp} devices: {e}") from None
        self.ddp = cfg.ddp.replace(num_microbatches=g)
        if t.global_batch % jax.process_count():
            raise UsageError(
                f"--global-batch {t.global_batch} is not divisible by the "
                f"{jax.process_count()} processes."
            )
        self.corpus = load_corpus(cfg.data, cfg.model.context)
        self.model = GPT(cfg.model)
        key = jax.random.key(t.seed)
        dummy = jnp.zeros((1, cfg.model.context), jnp.int32)
        # Host copies: every process starts from the same values, committed to no device.
        self.params0 = jax.tree.map(np.asarray, jax.jit(self.model.init)(key, dummy)["params"])
        model = self.model

        def loss_fn(params: Any, batch: Any) -> jax.Array:  # also the (dropout-free) eval loss
            return next_byte_loss(model, params, batch)

        def train_loss(params: Any, batch: Any, *, rng: jax.Array) -> jax.Array:
            return next_byte_loss(model, params, batch, rng=rng)

        self.loss_fn = loss_fn
        # With dropout the engine hands the loss a fresh key per step, rank and micro-batch,
        # folded from one run key: the stream is the same at any process count and the
        # checkpoint keeps it, so --resume continues it.
        self.rng = jax.random.fold_in(key, 1) if cfg.model.dropout > 0 else None
        self.engine = DataParallel(
            train_loss if self.rng is not None else loss_fn,
            make_optimizer(cfg, self.params0),
            self.ddp,
            mesh=self.mesh,
            # On GPUs: the combine thresholds that keep buckets apart and the scheduler settings
            # (jaxdp.xla_compiler_options), for the step only; XLA_FLAGS names win.
            compiler_options="jaxdp",
        )
        # shapes only: lets ZeRO-3 find the scanned block stack (GPTConfig.scan) and gather it
        # one layer per scan iteration
        shape = (t.global_batch, cfg.model.context + 1)
        example = {"tokens": jax.ShapeDtypeStruct(shape, jnp.int32)}
        init = functools.partial(self.engine.init, example_batch=example)
        ckpt_dir = os.path.abspath(os.path.join(args.out, "checkpoints"))
        self.resume_step: int | None = None
        if args.resume:
            jax.eval_shape(lambda p, k: init(p, rng=k), self.params0, self.rng)
            self.ckpt = CheckpointManager(ckpt_dir, self.engine)
            self.resume_step = self.ckpt.latest_step()
            if self.resume_step is None:
                raise UsageError(
                    f"--resume: {ckpt_dir} holds no complete checkpoint. Fix: drop --resume "
                    "(with --overwrite) to start again."
                )
            self.state = self.ckpt.restore(self.resume_step)
        else:
            # Every process has checked OUT before any process changes it.
            self._barrier("out-checked")
            if args.overwrite and self.lead:
                clear_run(args.out)
            self._barrier("out-cleared")
            self.state = init(self.params0, rng=self.rng)
            self.ckpt = CheckpointManager(ckpt_dir, self.engine)
        p, n = jax.process_index(), jax.process_count()
        per = t.global_batch // n
        self.rows = slice(p * per, (p + 1) * per)

    @staticmethod
    def _barrier(name: str) -> None:
        if jax.process_count() > 1:
            multihost_utils.sync_global_devices(name)

    # ------------------------------------------------------------------ data
    def batch(self, data: np.ndarray, seed: int, step: int) -> Any:
        t, ctx = self.cfg.train, self.cfg.model.context
        rows = batch_rows(data, seed, step, t.global_batch, ctx, self.rows)
        return self.engine.shard_batch({"tokens": rows})

    def val_loss(self, eval_fn: Any) -> float:
        t = self.cfg.train
        params = self.engine.params(self.state)
        total = 0.0
        for i in range(t.eval_batches):
            b = self.batch(self.corpus.val, t.seed + _EVAL_SEED_OFFSET, i)
            total += float(eval_fn(params, b))
        return total / t.eval_batches

    # ------------------------------------------------------------------ run
    def run(self) -> int:
        """Train to ``train.steps``, or until SIGTERM / SIGINT (then every process stops at the
        same step and checkpoints it). Returns the exit status (0)."""
        cfg, args, t = self.cfg, self.args, self.cfg.train
        out = args.out
        if self.lead:
            os.makedirs(out, exist_ok=True)
            with open(os.path.join(out, "config.yaml"), "w", encoding="utf-8") as f:
                f.write(cfg.to_yaml())
        log = (
            MetricsLog(os.path.join(out, "metrics.jsonl"), self.resume_step) if self.lead else None
        )
        dp, eng = self.engine.dp, self.engine
        n_params = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(self.params0))
        start = int(self.resume_step or 0)
        self.console.print(
            f"[bold]jaxdp-train[/]: GPT {cfg.model.layers}x{cfg.model.width} ({n_params:,} "
            f"params), {dp} x {jax.devices()[0].platform} devices in {jax.process_count()} "
            f"process(es), ZeRO {self.ddp.zero_stage}, global batch {t.global_batch} = "
            f"{t.micro_batch} x {self.ddp.num_microbatches} x {dp}; corpus "
            f"{self.corpus.source} ({self.corpus.train.size:,} train / "
            f"{self.corpus.val.size:,} val bytes)"
            + (f"; resumed at step {start}" if self.resume_step is not None else "")
        )
        if eng.plan.buckets is not None:  # the bucket size and the link model's prediction
            self.console.print(eng.plan.buckets.describe())
        step_options = eng.step_compiler_options
        if step_options:
            self.console.print(
                "XLA options for the step (jaxdp.xla_compiler_options and the passes its "
                "collectives need off): " + ", ".join(f"{k}={v}" for k, v in step_options.items())
            )
        eval_fn = jax.jit(self.loss_fn)
        tokens_per_step = t.global_batch * cfg.model.context
        flops_per_token = train_flops_per_token(cfg.model, n_params)
        kind = jax.devices()[0].device_kind
        t_wall = time.perf_counter()
        compile_s = 0.0
        steady_time, steady_steps = 0.0, 0
        losses: list[float] = []
        val: float | None = None
        last_log_t, last_log_step = time.perf_counter(), start
        spikes = SpikeLog(eng.layout)
        progress = Progress(
            TextColumn("[progress.description]{task.description}"),
            BarColumn(),
            TextColumn("{task.completed}/{task.total}"),
            TimeElapsedColumn(),
            TimeRemainingColumn(),
            console=self.console,
            disable=not self.lead,
        )
        agreement = StopAgreement(self.engine.mesh)
        profiler = StepProfiler(out, getattr(args, "profile", None), start, t.steps)
        stop_signal, saved, stopped_at = 0, None, None
        self.signals.arm()
        with progress:
            task = progress.add_task("compiling", total=t.steps, completed=start)
            for step in range(start + 1, t.steps + 1):
                self.progress.report(step, "step")
                with profiler.step(step, self.state):
                    t0 = time.perf_counter()
                    batch = self.batch(self.corpus.train, t.seed, step)
                    self.state, metrics = eng.step(self.state, batch)
                profiler.after(step, self.state)
                last_log_t += profiler.take_overhead()  # tracing is not training time
                spikes.add(metrics)  # on the device: read at the next logged step
                # Every process gets the same answer at the same step (see _stop.py).
                stop_signal = agreement.check(step, self.signals.signum)
                logging = step % t.log_every == 0 or step == t.steps or step == start + 1
                if logging:
                    loss = float(metrics["loss"])  # waits for the step
                if step == start + 1:
                    jax.block_until_ready(self.state)
                    compile_s = time.perf_counter() - t0
                    last_log_t = time.perf_counter()
                    last_log_step = step
                else:
                    steady_steps += 1
                do_eval = step % t.eval_every == 0 or step == t.steps
                if logging:
                    now = time.perf_counter()
                    n = max(step - last_log_step, 1)
                    step_time = (now - last_log_t) / n if step > last_log_step else compile_s
                    if step > last_log_step:
                        steady_time += now - last_log_t
                    rec: dict[str, Any] = {
                        "step": step,
                        "loss": loss,
                        "grad_norm": float(metrics["grad_norm"]),
                        "tokens_per_s": tokens_per_step / step_time,
                    }
                    warning = spikes.read(step)
                    if warning and self.lead:
                        self.console.print(f"[yellow]warning:[/] {warning}")
                    if spikes.enabled:
                        rec["skipped_steps"] = spikes.total
                    util = mfu(rec["tokens_per_s"], flops_per_token, dp, kind)
                    if util is not None and step > start + 1:  # not the compiling step
                        rec["mfu"] = util
                    losses.append(loss)
                    if do_eval:
                        self.progress.report(step, "eval")
                        val = self.val_loss(eval_fn)
                        rec["val_loss"] = val
                    if log is not None:
                        log.append(rec)
                    progress.update(
                        task,
                        description=f"loss {loss:.3f} | {rec['tokens_per_s']:,.0f} tok/s | "
                        f"{1000 * step_time:.0f} ms/step"
                        + (f" | val {val:.3f}" if val is not None else ""),
                    )
                    last_log_t, last_log_step = time.perf_counter(), step
                elif do_eval:
                    self.progress.report(step, "eval")
                    val = self.val_loss(eval_fn)
                    last_log_t = time.perf_counter()
                if step % t.checkpoint_every == 0 or step == t.steps:
                    self.progress.report(step, "checkpoint")
                    self.ckpt.save(step, self.state)
                    saved = step
                    last_log_t = time.perf_counter()
                progress.update(task, completed=step)
                if stop_signal and step < t.steps:
                    self.signals.settled()
                    if saved != step:
                        self.progress.report(step, "checkpoint")
                        self.ckpt.save(step, self.state)
                    stopped_at = step
                    break
                self.progress.report(step, "finished")
        profiler.stop()  # a run stopped by a signal inside the traced steps
        self.progress.report(stopped_at or t.steps, "end")
        self.signals.settled()
        self.ckpt.wait_until_finished()
        self.ckpt.close()
        if stopped_at is not None:
            print(
                f"jaxdp-train: stopped by {signal_name(stop_signal)} at step {stopped_at}; "
                f"checkpoint saved; continue with --resume (--out {out})",
                flush=True,
            )
            self._barrier("stopped")
            return 0
        wall = time.perf_counter() - t_wall
        if not losses:
            self._barrier("done")
            return 0
        sample = None
        if t.sample_bytes:
            # A collective (the ZeRO master weights are gathered): every process calls it.
            full = eng.params(self.state)
            if self.lead:
                params = jax.tree.map(lambda x: x.addressable_data(0), full)
                key = jax.random.key(t.seed)
                raw = generate(self.model, params, b"def ", t.sample_bytes, key)
                sample = "def " + raw.decode("utf-8", errors="replace")
        if not self.lead:
            self._barrier("done")
            return 0
        records = log.records if log is not None else []
        layout = eng.layout
        leaves = jax.tree.leaves(self.state)
        on_host = [x.sharding.memory_kind == "pinned_host" for x in leaves]
        shard_bytes = [x.addressable_shards[0].data.nbytes for x in leaves]
        state_bytes = sum(b for b, h in zip(shard_bytes, on_host, strict=True) if not h)
        host_bytes = sum(b for b, h in zip(shard_bytes, on_host, strict=True) if h)
        opt_bytes = sum(
            x.addressable_shards[0].data.nbytes for x in jax.tree.leaves(self.state.opt_state)
        )
        step_time = steady_time / steady_steps if steady_steps else compile_s
        info = {
            "params": n_params,
            "devices": f"{dp} x {jax.devices()[0].platform} in {jax.process_count()} process(es)",
            "zero_stage": self.ddp.zero_stage,
            "num_microbatches": self.ddp.num_microbatches,
            "buckets": len(layout.buckets),
            "bucket_numel": sum(b.numel for b in layout.buckets),
            "state_bytes_per_device": state_bytes,
            "host_state_bytes_per_device": host_bytes,
            "opt_state_bytes_per_device": opt_bytes,
            "moment_dtypes": (self.ddp.exp_avg_dtype, self.ddp.exp_avg_sq_dtype),
            "bytes_per_step": eng.plan.strategy.bytes_per_step(),
            "bytes_across_instances": eng.plan.strategy.bytes_across_instances(),
            "first_step": start,
            "last_step": t.steps,
            "loss_first": records[0]["loss"] if records else losses[0],
            "loss_last": losses[-1],
            "val_loss": val,
            "unigram_entropy": self.corpus.unigram_entropy(),
            "tokens_per_s": tokens_per_step / step_time if step_time else 0.0,
            "mfu": mfu(
                tokens_per_step / step_time if step_time else 0.0, flops_per_token, dp, kind
            ),
            "step_time_s": step_time,
            "skipped_steps": spikes.total if spikes.enabled else None,
            "compile_s": compile_s,
            "wall_s": wall,
            # what the step compiled with beyond XLA_FLAGS (jaxdp.xla_compiler_options on GPUs,
            # and the XLA passes its collectives need off)
            "xla_options": dict(eng.step_compiler_options or {}),
            # --profile: medians of the traced steps (jaxdp/train/_meter.py), in ms
            "exposed_communication": profiler.summary,
        }
        plot_loss(records, os.path.join(out, "loss.png"), info["unigram_entropy"])
        with open(os.path.join(out, "summary.json"), "w", encoding="utf-8") as f:
            json.dump({**info, "sample": sample}, f, indent=1)
        print_summary(self.console, info, sample)
        if profiler.line is not None:
            self.console.print(
                f"exposed communication ({profiler.dir}/meter.json): {profiler.line}"
            )
        elif profiler.error is not None:
            self.console.print(f"[yellow]warning:[/] {profiler.error}")
        self._barrier("done")
        return 0


class SpikeLog:
    """Steps the engine skipped for an abnormal gradient (``grad_norm_skip_threshold``,
    ``check_for_large_grads``): counted on the device, read only at logged steps, so the loop
    does not wait for every step."""

    def __init__(self, layout: Any):
        self.layout, self.enabled, self.total = layout, False, 0
        self._count: Any = None  # skipped steps since the last read (a device scalar)
        self._bucket: Any = None  # the last bucket over its limit, or -1

    def add(self, metrics: dict[str, Any]) -> None:
        if "skipped" not in metrics:
            return
        self.enabled = True
        n = metrics["skipped"]
        self._count = n if self._count is None else self._count + n
        if "large_grad_bucket" in metrics:
            b = metrics["large_grad_bucket"]
            self._bucket = b if self._bucket is None else jnp.where(b >= 0, b, self._bucket)

    def read(self, step: int) -> str | None:
        """A warning for the steps skipped since the last read, or ``None``."""
        if self._count is None:
            return None
        n, bucket = int(self._count), -1 if self._bucket is None else int(self._bucket)
        self._count = self._bucket = None
        if n == 0:
            return None
        self.total += n
        why = "gradient norm over grad_norm_skip_threshold or not finite"
        if bucket >= 0:
            paths = ", ".join(self.layout.buckets[bucket].param_paths[:4])
            why = f"bucket {bucket} ({paths}) over 10x its recent gradient norms"
        return f"skipped {n} step(s) up to step {step}: {why}; {self.total} skipped in all"
