"""What the scripts in bench/ share: the simulated devices, timing, compile-only H100s, memory
and HLO sizes, Markdown tables, and writing BENCHMARKS.md (sections, plots, readings).

Nothing here imports jax at module level: a script imports this first and asks for its devices
(``os.environ.update(H.cpu_devices())``) before its own ``import jax``.
"""

from __future__ import annotations

import contextlib
import datetime
import io
import os
import platform
import re
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
GIB = 2.0**30
MIB = 2.0**20


# ---------------------------------------------------------------------- processes and devices
def cpu_devices(n: int = 8) -> dict[str, str]:
    """The environment for ``n`` simulated CPU devices, for ``os.environ.update`` before the
    first ``import jax`` (empty once jax is imported: its backend keeps what it started with;
    the flag is added once, however many scripts ask).
    Simulated CPU devices by design: any installed GPU plugin (and its start-up errors) is
    skipped unless ``JAX_PLATFORMS`` says otherwise."""
    flag, flags = f"--xla_force_host_platform_device_count={n}", os.environ.get("XLA_FLAGS", "")
    if "jax" in sys.modules:
        return {}
    flags = flags if flag in flags.split() else f"{flags} {flag}".strip()
    return {"XLA_FLAGS": flags, "JAX_PLATFORMS": os.environ.get("JAX_PLATFORMS", "cpu")}


def python(
    args: Sequence[str], env: dict[str, str] | None = None, **kw: Any
) -> subprocess.CompletedProcess[str]:
    """``python ARGS`` in a fresh process from the repository root, with ``env`` over this
    process's environment; its output captured as text."""
    return subprocess.run(
        [sys.executable, *args],
        cwd=ROOT,
        env={**os.environ, **(env or {})},
        capture_output=True,
        text=True,
        **kw,
    )


def h100_mesh(n: int) -> tuple[Any, str]:
    """``(jaxdp.aot.h100_mesh(n), "")``, or ``(None, why)`` without the ``gpu-aot`` extra."""
    from jaxdp import aot

    try:
        return aot.h100_mesh(n), ""
    except Exception as e:  # the gpu-aot extra is missing
        return None, f"compile-only H100 devices unavailable ({type(e).__name__}: {e})"


# ---------------------------------------------------------------------- timing
def median(xs: Iterable[float]) -> float:
    return statistics.median(xs)


def rounds(
    runs: dict[str, Callable[[int], Any]], rounds: int, inner: int = 1, warmup: int = 1
) -> dict[str, list[float]]:
    """Seconds per call of each ``runs[name](k)`` (which makes ``k`` calls and blocks), after
    ``warmup`` calls each: the variants take turns, ``rounds`` rounds of ``inner`` calls, so
    that a slow spell of the machine falls on all of them (paired rounds)."""
    for run in runs.values():
        if warmup:
            run(warmup)
    times: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(rounds):
        for name, run in runs.items():
            t0 = time.perf_counter()
            run(inner)
            times[name].append((time.perf_counter() - t0) / inner)
    return times


def median_time(run: Callable[[int], Any], n: int, inner: int = 1, warmup: int = 1) -> float:
    """Median seconds per call of ``run`` (see :func:`rounds`)."""
    return median(rounds({"": run}, n, inner, warmup)[""])


def repeat(fn: Callable[[], Any]) -> Callable[[int], Any]:
    """``fn`` as a :func:`rounds` run: ``k`` calls, then block on the last result."""

    def run(k: int) -> Any:
        import jax

        out = None
        for _ in range(k):
            out = fn()
        return jax.block_until_ready(out)

    return run


# ---------------------------------------------------------------------- sizes
ITEMSIZE = {"pred": 1, "s8": 1, "u8": 1, "f8e4m3fn": 1, "f8e5m2": 1, "s16": 2, "u16": 2, "f16": 2}
ITEMSIZE |= {"bf16": 2, "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8}
ARRAY = re.compile(r"\b(" + "|".join(ITEMSIZE) + r")\[([0-9,]*)\]")


def array_bytes(text: str) -> int:
    """Bytes of every array shape (``f32[8,128]``) written in ``text``."""
    total = 0
    for dtype, dims in ARRAY.findall(text):
        n = 1
        for d in filter(None, dims.split(",")):
            n *= int(d)
        total += n * ITEMSIZE[dtype]
    return total


def total_bytes(m: Any) -> int:
    """Per-device bytes of a ``compiled.memory_analysis()``: argument + output - alias + temp."""
    return int(
        m.argument_size_in_bytes
        + m.output_size_in_bytes
        - m.alias_size_in_bytes
        + m.temp_size_in_bytes
    )


def abstract(tree: Any, shardings: Any = None) -> Any:
    """``jax.ShapeDtypeStruct``s of ``tree`` (``shardings``: a tree like it, or one for all)."""
    import jax

    if shardings is None or isinstance(shardings, jax.sharding.Sharding):
        return jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=shardings), tree
        )
    return jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, shardings
    )


# ---------------------------------------------------------------------- Markdown
def table(header: Sequence[str], rows: Iterable[Sequence[Any]], align: str = "") -> str:
    """A Markdown table; ``align`` has one letter per column, ``l`` or ``r`` (default: the
    first column left, the others right)."""
    align = align or "l" + "r" * (len(header) - 1)
    rule = "|" + "|".join("---" if a == "l" else "---:" for a in align) + "|"
    lines = ["| " + " | ".join(header) + " |", rule]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def reading(name: str, part: str = "", **values: Any) -> str:
    """The prose of ``bench/readings/<name>.md`` (or its ``<!-- part: PART -->``), with the
    measured ``values`` put into its ``{placeholders}`` (formatted only when values are given)."""
    with open(os.path.join(HERE, "readings", f"{name}.md")) as f:
        pieces = re.split(r"^<!-- part: (\S+) -->\n", f.read(), flags=re.M)
    parts = {"": pieces[0], **dict(zip(pieces[1::2], pieces[2::2]))}
    text = parts[part].removesuffix("\n")
    return text.format(**values) if values else text


def plot_target(plots: str | None, name: str) -> tuple[str, str]:
    """``(path to write, link for the Markdown)``: ``bench/<name>`` linked relative to the
    repository root by default, or ``<plots>/<name>`` linked by its own path."""
    path = os.path.join(plots or HERE, name)
    return path, (os.path.relpath(path, ROOT) if plots is None else path)


def splice_section(path: str, number: int, text: str, append: bool = False) -> None:
    r"""Replace section ``number`` of ``path``, from its ``## N.`` heading up to the next
    ``## `` heading, by ``text``; the rest of the file is kept as it was. With ``append``, a
    section the file does not have yet is added at its end.

    >>> import os, tempfile
    >>> p = os.path.join(tempfile.mkdtemp(), "B.md")
    >>> _ = open(p, "w").write("# B\n\n## 6. a\nold 6\n\n## 7. b\nold 7\n\n## 8. c\nold 8\n")
    >>> splice_section(p, 7, "## 7. b\nnew 7")
    >>> print(open(p).read(), end="")
    # B
    <BLANKLINE>
    ## 6. a
    old 6
    <BLANKLINE>
    ## 7. b
    new 7
    <BLANKLINE>
    ## 8. c
    old 8
    """
    with open(path) as f:
        doc = f.read()
    m = re.search(rf"^## {number}\. .*?(?=^## |\Z)", doc, re.M | re.S)
    if m is None and append:
        with open(path, "w") as f:
            f.write(doc.rstrip() + "\n\n" + text.rstrip() + "\n")
        return
    if m is None:
        numbers = [int(n) for n in re.findall(r"^## (\d+)\. ", doc, re.M)]
        if numbers and number > max(numbers):  # a new last section: appended
            with open(path, "w") as f:
                f.write(doc.rstrip() + "\n\n" + text.rstrip() + "\n")
            return
        raise SystemExit(f"run_all: {path} has no section {number} to replace; run without --only")
    with open(path, "w") as f:
        f.write(doc[: m.start()] + text.rstrip() + "\n\n" + doc[m.end() :])


def write_block(path: str, body: str, name: str = "") -> None:
    """Replace the text between the ``bench_gpu{name}`` markers of ``path`` (append them, under
    a GPU heading, if missing)."""
    text = ""
    if os.path.exists(path):
        with open(path) as f:
            text = f.read()
    start, end = f"<!-- bench_gpu{name}:start -->", f"<!-- bench_gpu{name}:end -->"
    block = f"{start}\n{body}\n{end}"
    if start in text and end in text:
        text = text[: text.index(start)] + block + text[text.index(end) + len(end) :]
    else:
        text = text.rstrip() + "\n\n## GPU: `bench/bench_gpu.py`\n\n" + block + "\n"
    with open(path, "w") as f:
        f.write(text)


# ---------------------------------------------------------------------- provenance
class _Tee(io.StringIO):
    """Capture what a benchmark prints while still showing it."""

    def write(self, s: str) -> int:
        sys.__stdout__.write(s)
        sys.__stdout__.flush()
        return super().write(s)


def timed(fn: Callable[[], Any]) -> tuple[Any, str, float]:
    """``fn()``'s result, what it printed, and its seconds."""
    buf = _Tee()
    t0 = time.perf_counter()
    with contextlib.redirect_stdout(buf):
        out = fn()
    return out, buf.getvalue(), time.perf_counter() - t0


def _git(*args: str) -> str:
    try:
        return subprocess.run(
            ["git", *args], cwd=ROOT, capture_output=True, text=True, check=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return ""


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _mem_gib() -> str:
    try:
        with open("/proc/meminfo") as f:
            kib = int(f.readline().split()[1])
        return f"{kib / 2**20:.0f} GiB"
    except (OSError, ValueError, IndexError):
        return "unknown"


def source() -> str:
    """The commit measured, and whether jaxdp/ differed from it."""
    head = _git("rev-parse", "--short", "HEAD") or "unknown"
    dirty = _git("status", "--porcelain", "--", "jaxdp")
    return f"`{head}`" + (
        # each line is "XY path"; _git strips the output, and with it the first line's X
        f", with uncommitted changes in jaxdp/: "
        f"{', '.join(ln.split(maxsplit=1)[-1] for ln in dirty.splitlines())}"
        if dirty
        else ", jaxdp/ clean"
    )


def now() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M")


def machine() -> str:
    """The Machine section's table: date, commit, CPU, memory, versions, devices, flags."""
    from importlib.metadata import version

    import jax

    devs = jax.devices()
    packages = ("jax", "jaxlib", "flax", "optax", "numpy", "jaxdp")
    rows = [
        ("Date (UTC)", now()),
        ("Commit", source()),
        ("CPU", f"{cpu_model()}, nproc = {os.cpu_count()}"),
        ("Memory", _mem_gib()),
        ("OS / Python", f"{platform.platform()} / {platform.python_version()}"),
        ("Versions", ", ".join(f"{p} {version(p)}" for p in packages)),
        ("Devices", f"{len(devs)} x {devs[0].platform} ({devs[0].device_kind}), simulated"),
        ("XLA_FLAGS", f"`{os.environ.get('XLA_FLAGS', '')}`"),
        ("JAX_PLATFORMS", f"`{os.environ.get('JAX_PLATFORMS', '')}`"),
    ]
    return table(["", ""], rows, "ll").replace("|  |  |", "| | |", 1)
