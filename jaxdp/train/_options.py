"""The main job's configuration: model, training and DDP sections, from YAML and ``--set``.

A run's configuration is three sections, each checked by name and type::

    model: {layers: 4, width: 128, heads: 4, context: 128}      # jaxdp.models.GPTConfig
    train: {steps: 300, global_batch: 32, micro_batch: 4, ...}  # TrainOptions
    ddp:   {zero_stage: 1, clip_grad: 1.0, ...}                 # jaxdp.DDPConfig

plus ``data`` (a path, or null for the standard library). The resolved configuration is written
to ``OUT/config.yaml``; ``--resume`` reads it back, so a resumed run trains the same model on
the same data with the same schedule.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import re
from typing import Any

import yaml

from .. import DDPConfig
from ..models.gpt import GPTConfig

__all__ = ["ConfigError", "RunConfig", "TrainOptions", "apply_set", "load_run_config"]


class ConfigError(ValueError):
    """A configuration file or ``--set`` names an unknown key or gives a value of the wrong type."""


@dataclasses.dataclass(frozen=True)
class TrainOptions:
    """Training-loop settings (the ``train:`` section).

    Attributes:
        steps: optimizer steps to train to (``--steps``).
        global_batch: sequences per step over all ranks (``--global-batch``).
        micro_batch: sequences per forward/backward pass per rank (``--micro-batch``).
        lr: peak AdamW learning rate.
        warmup: linear warm-up steps.
        decay_steps: cosine decay length; the rate then stays at ``lr * min_lr_ratio``. Fixed
            by the config, not by ``--steps``, so a run stopped early and resumed follows the
            same schedule.
        min_lr_ratio: final learning rate as a fraction of ``lr``.
        weight_decay: AdamW weight decay (matrices only).
        log_every: steps between lines of ``metrics.jsonl``.
        eval_every: steps between validation losses.
        eval_batches: global batches in one validation loss.
        checkpoint_every: steps between checkpoints (and one at the end).
        seed: seeds the parameters, the data order and the text sample.
        sample_bytes: length of the generated sample at the end (0: none).
    """

    steps: int = 300
    global_batch: int = 32
    micro_batch: int = 4
    lr: float = 3e-3
    warmup: int = 20
    decay_steps: int = 300
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.1
    log_every: int = 10
    eval_every: int = 50
    eval_batches: int = 2
    checkpoint_every: int = 100
    seed: int = 0
    sample_bytes: int = 200


#: DDP settings of the main job unless the config says otherwise. ``deterministic_reduction``
#: makes the losses independent of how devices are split into processes (docs/numerics.md).
DDP_DEFAULTS: dict[str, Any] = {"zero_stage": 1, "clip_grad": 1.0, "deterministic_reduction": True}


@dataclasses.dataclass(frozen=True)
class RunConfig:
    """The resolved configuration of one run."""

    model: GPTConfig
    train: TrainOptions
    ddp: DDPConfig
    data: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "model": dataclasses.asdict(self.model),
            "train": dataclasses.asdict(self.train),
            "ddp": self.ddp.to_dict(),
            "data": self.data,
        }

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)


_SECTIONS: dict[str, Any] = {"model": GPTConfig, "train": TrainOptions}


def _check_value(where: str, key: str, value: Any, expected: Any) -> Any:
    """Type-check ``value`` against the default's type (int, float, str)."""
    want = type(expected)
    ok = isinstance(value, want) and not (isinstance(value, bool) and want is not bool)
    if want is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if not ok:
        raise ConfigError(
            f"{where}: {key}={value!r} is a {type(value).__name__}; expected a {want.__name__} "
            f"(default {expected!r}). Fix: e.g. {key}: {expected!r}."
        )
    return value


def _section(cls: Any, data: Any, where: str) -> Any:
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(
            f"{where}: expected a mapping of keys to values; got {type(data).__name__}. "
            "Fix: write 'key: value' lines under the section."
        )
    fields = {f.name: f.default for f in dataclasses.fields(cls)}
    out = {}
    for k, v in data.items():
        if k not in fields:
            close = difflib.get_close_matches(str(k), list(fields), n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ConfigError(
                f"{where}: unknown key {k!r}{hint}; expected one of {sorted(fields)}. "
                "Fix: rename or remove it."
            )
        out[k] = _check_value(where, k, v, fields[k])
    try:
        return cls(**out)
    except (TypeError, ValueError) as e:
        raise ConfigError(f"{where}: {e}") from None


def _ddp(data: Any, where: str) -> DDPConfig:
    merged = dict(DDP_DEFAULTS)
    if data is not None:
        if not isinstance(data, dict):
            raise ConfigError(f"{where}: expected a mapping of DDPConfig fields; got {data!r}.")
        merged.update(data)
    try:
        return DDPConfig.from_dict(merged, source=where)
    except (TypeError, ValueError) as e:
        raise ConfigError(f"{where}: {e}") from None


def from_mapping(data: Any, where: str) -> RunConfig:
    """Build a :class:`RunConfig` from the YAML mapping ``data`` (read from ``where``)."""
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(
            f"{where}: the file holds a {type(data).__name__}; expected the sections model:, "
            "train:, ddp: and data:."
        )
    unknown = [k for k in data if k not in ("model", "train", "ddp", "data")]
    if unknown:
        raise ConfigError(
            f"{where}: unknown section {unknown[0]!r}; expected model, train, ddp or data. "
            "Fix: put the key under one of those sections."
        )
    d = data.get("data")
    if d is not None and not isinstance(d, str):
        raise ConfigError(f"{where}: data={d!r}; expected a path string or null.")
    return RunConfig(
        model=_section(GPTConfig, data.get("model"), f"{where} [model]"),
        train=_section(TrainOptions, data.get("train"), f"{where} [train]"),
        ddp=_ddp(data.get("ddp"), f"{where} [ddp]"),
        data=d,
    )


def load_run_config(path: str | None) -> RunConfig:
    """The defaults (``path=None``) or the YAML file ``path``."""
    if path is None:
        return from_mapping({}, "defaults")
    if not os.path.isfile(path):
        raise ConfigError(
            f"--config {path}: no such file. Fix: pass an existing YAML file such as "
            "configs/gpt_tiny.yaml, or leave --config out for the defaults."
        )
    try:
        with open(path, encoding="utf-8") as f:
            data = yaml.safe_load(f)
    except yaml.YAMLError as e:
        raise ConfigError(f"--config {path}: not valid YAML ({e}).") from None
    return from_mapping(data, path)


#: A number in exponent notation without a dot (``1e-9``), which YAML 1.1 reads as a string.
_EXPONENT = re.compile(r"[+-]?(\d+\.?\d*|\.\d+)[eE][+-]?\d+")


def apply_set(cfg: RunConfig, assignments: list[str]) -> RunConfig:
    """Apply ``--set key=value`` items: ``model.X``, ``train.X``, ``ddp.X`` or a bare DDPConfig
    field ``X``; values are parsed as YAML (``true``, ``2``, ``1e-3``, ``null``)."""
    data = cfg.to_dict()
    for item in assignments:
        key, eq, raw = item.partition("=")
        if not eq or not key:
            raise ConfigError(
                f"--set {item!r}: expected key=value. Fix: e.g. --set zero_stage=2 or "
                "--set train.lr=1e-3."
            )
        try:
            value = yaml.safe_load(raw)
        except yaml.YAMLError:
            value = raw
        if isinstance(value, str) and _EXPONENT.fullmatch(value.strip()):
            value = float(value)  # YAML 1.1 reads 1e-9 (no dot) as a string
        section, dot, name = key.partition(".")
        if not dot:
            section, name = "ddp", key
        if section not in ("model", "train", "ddp") and key != "data":
            raise ConfigError(
                f"--set {item!r}: unknown section {section!r}; expected a DDPConfig field or "
                "model.KEY / train.KEY / ddp.KEY."
            )
        if key == "data":
            data["data"] = value
        else:
            data[section][name] = value
    return from_mapping(data, "--set")


def replace_train(cfg: RunConfig, **changes: Any) -> RunConfig:
    """``cfg`` with training options changed (from command-line flags), checked again."""
    changes = {k: v for k, v in changes.items() if v is not None}
    data = cfg.to_dict()
    data["train"].update(changes)
    return from_mapping(data, "command line")
