"""Which XLA GPU flags exist in which jaxlib release: ``FLAG_TABLE`` and the version checks.

XLA aborts the whole process on a flag it does not know, and flags come and go between
releases, so every flag :mod:`jaxdp._src.platform.xla_flags` emits is looked up in ``FLAG_TABLE``
(the first
jaxlib release that has it and, where it was removed, the first that does not) before it is
emitted. The table was built from the flag names compiled into the shared libraries of 27 jaxlib
wheels from PyPI (0.4.13 to 0.10.2); the tests check it against the installed jaxlib by starting
a process with every allowed flag, and one with each denied flag.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import re
import warnings
from typing import Final

__all__ = ["FLAG_TABLE", "SEEN_ACCEPTED", "FlagSpec", "flag_available"]

Version = tuple[int, ...]

#: Oldest and newest jaxlib releases whose flags were read into ``FLAG_TABLE``.
OLDEST_CHECKED: Final[Version] = (0, 4, 13)
NEWEST_CHECKED: Final[Version] = (0, 10, 2)


@dataclasses.dataclass(frozen=True)
class FlagSpec:
    """When an XLA flag exists.

    Attributes:
        name: the flag without ``--``.
        since: first jaxlib release that accepts it (``OLDEST_CHECKED`` means "that one or
            earlier"); ``None``: no checked release accepts it.
        removed: first jaxlib release that rejects it again, or ``None``.
        kind: the value type, ``"bool"``, ``"int"`` or ``"str"``.
        example: a value the flag accepts (used by the tests that check the table).
        note: what the flag does.
    """

    name: str
    since: Version | None
    removed: Version | None = None
    kind: str = "bool"
    example: str = "false"
    note: str = ""

    def available(self, version: Version) -> bool:
        """Whether jaxlib ``version`` accepts the flag."""
        if self.since is None or version < self.since:
            return False
        return self.removed is None or version < self.removed


_V = OLDEST_CHECKED
#: Flags jaxdp emits or has to avoid, read from the jaxlib wheels (see the module docstring).
FLAG_TABLE: Final[tuple[FlagSpec, ...]] = (
    FlagSpec(
        "xla_gpu_all_reduce_combine_threshold_bytes",
        _V,
        kind="int",
        example="1",
        note="max bytes of a combined all-reduce",
    ),
    FlagSpec(
        "xla_gpu_reduce_scatter_combine_threshold_bytes",
        _V,
        kind="int",
        example="1",
        note="max output (scattered) bytes of a combined reduce-scatter",
    ),
    FlagSpec(
        "xla_gpu_all_gather_combine_threshold_bytes",
        _V,
        kind="int",
        example="1",
        note="max output (gathered) bytes of a combined all-gather",
    ),
    FlagSpec("xla_gpu_enable_latency_hiding_scheduler", _V, note="cost-model scheduler (LHS)"),
    FlagSpec(
        "xla_gpu_enable_highest_priority_async_stream",
        _V,
        note="async collectives on a high-priority stream (default true)",
    ),
    FlagSpec("xla_gpu_enable_pipelined_reduce_scatter", (0, 4, 18), note="pipeline RS in loops"),
    FlagSpec(
        "xla_gpu_enable_pipelined_all_gather",
        (0, 4, 18),
        note="start a loop's next all-gather during this iteration (ZeRO-3 scanned layers)",
    ),
    FlagSpec("xla_gpu_enable_reduce_scatter_combine_by_dim", (0, 4, 20)),
    FlagSpec("xla_gpu_enable_all_gather_combine_by_dim", (0, 4, 20)),
    FlagSpec("xla_gpu_disable_async_collectives", (0, 4, 27), kind="str", example="ALLREDUCE"),
    FlagSpec(
        "xla_gpu_experimental_parallel_collective_overlap_limit",
        (0, 4, 35),
        kind="int",
        example="1",
    ),
    FlagSpec("xla_gpu_enable_analytical_sol_latency_estimator", (0, 5, 0)),
    FlagSpec(
        "xla_gpu_enable_analytical_latency_estimator",
        (0, 4, 16),
        note="LHS cost model from XLA's GPU performance model (ZeRO-3 with micro-batches, "
        "jaxlib < 0.11: 0.11.2 aborts in it)",
    ),
    FlagSpec(
        "xla_gpu_experimental_enable_heuristic_collective_combining",
        (0, 7, 0),
        note="heuristic thresholds that would override the ones jaxdp sets",
    ),
    FlagSpec("xla_gpu_collective_combine_threshold_count", (0, 10, 0), kind="int", example="2048"),
    FlagSpec(
        "xla_gpu_nccl_termination_timeout_seconds",
        _V,
        kind="int",
        example="600",
        note="a collective stuck this long fails instead of waiting forever (-1: off); "
        "jaxdp-train sets it to --hang-timeout",
    ),
    FlagSpec("xla_gpu_experimental_collective_start_as_early_as_possible", (0, 10, 2)),
    # Removed: async collectives became unconditional.
    FlagSpec("xla_gpu_enable_async_collectives", (0, 4, 18), removed=(0, 4, 27)),
    FlagSpec("xla_gpu_enable_async_all_reduce", _V, removed=(0, 4, 27)),
    FlagSpec("xla_gpu_enable_async_reduce_scatter", _V, removed=(0, 4, 27)),
    FlagSpec("xla_gpu_enable_async_all_gather", _V, removed=(0, 4, 27)),
    # Newer XLA (used by MaxText); in no checked jaxlib release.
    FlagSpec("xla_gpu_pipeline_reduce_scatter", None, kind="str", example="on"),
    FlagSpec("xla_gpu_pipeline_all_gather", None, kind="str", example="on"),
)
_BY_NAME: Final = {f.name: f for f in FLAG_TABLE}


def _parse_version(value: str | Version, arg: str = "jaxlib_version") -> Version:
    if isinstance(value, tuple) and value and all(isinstance(v, int) for v in value):
        return tuple(value)
    if isinstance(value, str):
        m = re.match(r"^\s*(\d+)\.(\d+)(?:\.(\d+))?", value)
        if m:
            return tuple(int(x) for x in m.groups(default="0"))
    raise ValueError(
        f"xla_flags: {arg}={value!r}; expected a version string like '0.10.2' or a tuple of "
        "ints like (0, 10, 2). Fix: pass jaxlib.version.__version__ of the target machine, or "
        "None for the installed jaxlib."
    )


def _resolve_version(value: str | Version | None = None) -> Version:
    """The jaxlib version as a tuple: ``value`` parsed, or the installed one when ``None``.

    Reads the installed version from the package metadata, so it starts no backend.

    Example:
        >>> _resolve_version("0.10.2.dev20260101")
        (0, 10, 2)
    """
    if value is None:
        value = importlib.metadata.version("jaxlib")
    return _parse_version(value)


def flag_available(name: str, version: str | Version | None = None) -> bool:
    """Whether jaxlib ``version`` (default: the installed one) accepts ``--name``.

    Example:
        >>> flag_available("xla_gpu_enable_latency_hiding_scheduler", "0.10.2")
        True
        >>> flag_available("xla_gpu_enable_async_all_reduce", "0.10.2")  # removed in 0.4.27
        False
    """
    name = name.lstrip("-").split("=", 1)[0]
    if name not in _BY_NAME:
        raise ValueError(
            f"flag_available: name={name!r} is not in jaxdp's FLAG_TABLE; expected one of "
            f"{sorted(_BY_NAME)}. Fix: add it to FLAG_TABLE with the release that introduced it."
        )
    return _BY_NAME[name].available(_resolve_version(version))


#: Releases newer than ``NEWEST_CHECKED`` and the flags a process was seen to start its GPU
#: backend with there (``bench/bench_gpu.py`` tries its flags in a child process first):
#: emitting only these draws no warning.
SEEN_ACCEPTED: Final[dict[Version, frozenset[str]]] = {
    # One NVIDIA H200, jaxlib 0.11.2 (CUDA 13 plugin), 2026-11-26: the flags of a stage-1 config.
    (0, 11, 2): frozenset(
        {
            "xla_gpu_all_reduce_combine_threshold_bytes",
            "xla_gpu_reduce_scatter_combine_threshold_bytes",
            "xla_gpu_all_gather_combine_threshold_bytes",
            "xla_gpu_enable_latency_hiding_scheduler",
            "xla_gpu_enable_highest_priority_async_stream",
            "xla_gpu_experimental_enable_heuristic_collective_combining",
        }
    ),
}


def _version_for(value: str | Version | None, names: frozenset[str]) -> Version:
    """The jaxlib version flags are emitted for; warns when it is newer than the table, unless
    every flag in ``names`` was seen accepted by that release (:data:`SEEN_ACCEPTED`)."""
    version = _resolve_version(value)
    if version < OLDEST_CHECKED:
        raise ValueError(
            f"xla_flags: jaxlib_version={'.'.join(map(str, version))} is older than the oldest "
            f"jaxlib jaxdp's flag table was checked against "
            f"({'.'.join(map(str, OLDEST_CHECKED))}). Fix: upgrade jaxlib (jaxdp needs >= 0.10.2)."
        )
    seen = SEEN_ACCEPTED.get(version[:3], frozenset())
    if version > NEWEST_CHECKED and not names <= seen:
        unseen = f" ({', '.join(sorted(names - seen))} not seen there)"
        warnings.warn(
            f"xla_flags: jaxlib {'.'.join(map(str, version))} is newer than the newest release "
            f"jaxdp's flag table was checked against ({'.'.join(map(str, NEWEST_CHECKED))})"
            f"{unseen}; emitting the flags known there. If XLA aborts with 'Unknown flag in "
            "XLA_FLAGS', update jaxdp's FLAG_TABLE.",
            stacklevel=3,
        )
    return version
