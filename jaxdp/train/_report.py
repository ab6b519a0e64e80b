"""What the main job leaves behind: ``metrics.jsonl``, ``loss.png`` and the summary table."""

from __future__ import annotations

import json
import os
from typing import Any

from rich.console import Console
from rich.panel import Panel
from rich.table import Table

__all__ = ["MetricsLog", "plot_loss", "summary_table"]


class MetricsLog:
    """``OUT/metrics.jsonl``: one JSON object per logged step.

    On resume the lines after the restored step are dropped (they were logged by a run that
    went on past its last checkpoint), so the file reads as one uninterrupted run.
    """

    def __init__(self, path: str, resume_step: int | None = None):
        self.path = path
        self.records: list[dict[str, Any]] = []
        if resume_step is not None and os.path.exists(path):
            with open(path, encoding="utf-8") as f:
                for line in f:
                    if line.strip():
                        rec = json.loads(line)
                        if rec["step"] <= resume_step:
                            self.records.append(rec)
        with open(path, "w", encoding="utf-8") as f:
            f.writelines(json.dumps(r) + "\n" for r in self.records)

    def append(self, record: dict[str, Any]) -> None:
        self.records.append(record)
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(json.dumps(record) + "\n")


def plot_loss(records: list[dict[str, Any]], path: str, unigram: float | None = None) -> None:
    """Training and validation loss against step, saved to ``path`` (PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4), dpi=110)
    steps = [r["step"] for r in records]
    ax.plot(steps, [r["loss"] for r in records], label="train loss", lw=1.5)
    val = [(r["step"], r["val_loss"]) for r in records if r.get("val_loss") is not None]
    if val:
        ax.plot(*zip(*val, strict=True), "o-", label="validation loss", ms=4)
    if unigram is not None:
        ax.axhline(unigram, color="gray", ls="--", lw=1, label="unigram entropy of the bytes")
    ax.set_xlabel("step")
    ax.set_ylabel("next-byte cross-entropy (nats)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    tmp = path + ".tmp.png"
    fig.savefig(tmp)
    plt.close(fig)
    os.replace(tmp, path)


def _mib(x: float) -> str:
    return f"{x / 2**20:.2f} MiB"


def summary_table(info: dict[str, Any]) -> Table:
    """The end-of-run table (rows in the order a person reads them)."""
    t = Table(title="jaxdp-train summary", show_header=False)
    t.add_column("what", style="bold")
    t.add_column("value")
    rows = [
        ("parameters", f"{info['params']:,}"),
        ("devices", info["devices"]),
        ("ZeRO stage / micro-batches", f"{info['zero_stage']} / {info['num_microbatches']}"),
        ("buckets", f"{info['buckets']} ({info['bucket_numel']:,} elements)"),
        (
            "train state per device",
            _mib(info["state_bytes_per_device"])
            + (
                f" (+ {_mib(info['host_state_bytes_per_device'])} in host memory: "
                "optimizer_cpu_offload)"
                if info.get("host_state_bytes_per_device")
                else ""
            ),
        ),
        (
            "of which optimizer state",
            f"{_mib(info['opt_state_bytes_per_device'])} (Adam moments: "
            + " / ".join(info["moment_dtypes"])
            + ")",
        ),
        ("bytes moved per step per rank", _mib(info["bytes_per_step"])),
        ("of which across instances", _mib(info.get("bytes_across_instances", 0))),
        ("steps", f"{info['first_step']} -> {info['last_step']}"),
        ("loss (first -> last logged)", f"{info['loss_first']:.3f} -> {info['loss_last']:.3f}"),
        ("validation loss", "-" if info["val_loss"] is None else f"{info['val_loss']:.3f}"),
        ("unigram entropy of the bytes", f"{info['unigram_entropy']:.3f} nats"),
        ("tokens/s (after compile)", f"{info['tokens_per_s']:,.0f}"),
        (
            "MFU (dense bf16 peak)",
            "- (peak unknown for this device)" if info.get("mfu") is None else f"{info['mfu']:.1%}",
        ),
        ("step time", f"{1000 * info['step_time_s']:.0f} ms"),
        (
            "skipped steps (abnormal gradient)",
            "- (no spike checks)"
            if info.get("skipped_steps") is None
            else f"{info['skipped_steps']}",
        ),
        ("first step (compile)", f"{info['compile_s']:.1f} s"),
        ("wall time", f"{info['wall_s']:.1f} s"),
    ]
    meter = info.get("exposed_communication")
    if meter:
        rows.append(
            (
                "collectives / exposed (--profile)",
                f"{meter['collective_ms']:.3g} / {meter['exposed_ms']:.3g} ms per step "
                f"({meter['overlapped']:.0%} overlapped)",
            )
        )
    for k, v in rows:
        t.add_row(k, v)
    return t


def print_summary(console: Console, info: dict[str, Any], sample: str | None) -> None:
    console.print(summary_table(info))
    if sample is not None:
        console.print(Panel(sample, title="sample (after 'def ')", expand=False))
