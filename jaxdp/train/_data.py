"""The main job's corpus: bytes of text files, split by file into train and validation.

With no ``--data`` the corpus is the Python standard library's own ``.py`` files (found from the
running interpreter, without its ``test`` packages and ``site-packages``), so a fresh machine
needs no download. Files are sorted by path and assigned to the validation split by a hash of
their path (about 1 in 10), so the split is the same on every machine with the same files.

Batches are windows of ``context + 1`` bytes whose start offsets are a pure function of
``(seed, step)``: the data order survives a restart, and each process builds only its own rows
of the global batch (rows ``[i * B / P, (i + 1) * B / P)`` on process ``i`` of ``P``).
"""

from __future__ import annotations

import os
import sysconfig
import zlib
from dataclasses import dataclass

import numpy as np

__all__ = ["Corpus", "CorpusError", "default_corpus_root", "load_corpus"]

_TEXT_SUFFIXES = (".py", ".txt", ".md", ".rst", ".c", ".h", ".json", ".yaml", ".yml", ".toml")


class CorpusError(ValueError):
    """The data path is missing, empty or unreadable."""


def default_corpus_root() -> str:
    """The standard library folder of the running interpreter."""
    return sysconfig.get_paths()["stdlib"]


def _files(root: str, default: bool) -> list[str]:
    if os.path.isfile(root):
        return [root]
    out = []
    for d, dirs, files in os.walk(root):
        dirs[:] = sorted(
            x
            for x in dirs
            if not x.startswith(".")
            and not (
                default and x in ("site-packages", "dist-packages", "test", "tests", "idlelib")
            )
        )
        for f in sorted(files):
            if (f.endswith(".py") if default else f.endswith(_TEXT_SUFFIXES)) and not f.startswith(
                "."
            ):
                out.append(os.path.join(d, f))
    return out


@dataclass(frozen=True)
class Corpus:
    """Train and validation bytes (``uint8`` arrays) and where they came from."""

    train: np.ndarray
    val: np.ndarray
    source: str
    num_files: int

    def unigram_entropy(self) -> float:
        """Entropy of the training bytes' frequencies, in nats (what a model without context
        can reach)."""
        counts = np.bincount(self.train, minlength=256).astype(np.float64)
        p = counts[counts > 0] / counts.sum()
        return float(-(p * np.log(p)).sum())


def load_corpus(path: str | None, context: int, max_bytes: int = 16 << 20) -> Corpus:
    """Read the corpus (``path`` = a text file or folder; ``None`` = the standard library).

    Raises:
        CorpusError: ``path`` does not exist, holds no text files, or has too few bytes for
            one window of ``context + 1`` bytes in each split.
    """
    default = path is None
    root = default_corpus_root() if default else os.path.abspath(os.fspath(path))  # type: ignore[arg-type]
    if not os.path.exists(root):
        raise CorpusError(
            f"--data {path}: no such file or folder. Fix: pass an existing text file or folder, "
            "or leave --data out to train on the Python standard library."
        )
    files = _files(root, default)
    if not files:
        raise CorpusError(
            f"--data {path}: found no text files ({', '.join(_TEXT_SUFFIXES)}) in {root}. Fix: "
            "point --data at a text file or a folder holding some."
        )
    train: list[bytes] = []
    val: list[bytes] = []
    total = 0
    for f in files:
        try:
            with open(f, "rb") as fh:
                data = fh.read()
        except OSError:
            continue  # unreadable files (permissions, broken links) are skipped
        rel = os.path.relpath(f, root) if len(files) > 1 else "file"
        (val if len(files) > 1 and zlib.crc32(rel.encode()) % 10 == 0 else train).append(data)
        total += len(data)
        if total >= max_bytes:
            break
    if len(files) == 1 and train:
        # One file: the last tenth is the validation split.
        data = train[0]
        cut = len(data) - len(data) // 10
        train, val = [data[:cut]], [data[cut:]]
    tr = np.frombuffer(b"".join(train), np.uint8)
    va = np.frombuffer(b"".join(val), np.uint8)
    need = context + 1
    if tr.size < need or va.size < need:
        raise CorpusError(
            f"--data {path or root}: {tr.size} training and {va.size} validation bytes; each "
            f"split needs at least context + 1 = {need}. Fix: use more text (about "
            f"{20 * need} bytes or more), or a smaller context (--set model.context=N)."
        )
    return Corpus(train=tr, val=va, source=root, num_files=len(files))


def batch_rows(
    data: np.ndarray, seed: int, step: int, global_batch: int, context: int, rows: slice
) -> np.ndarray:
    """Rows ``rows`` of the global batch of step ``step``: ``int32 (n, context + 1)``.

    The offsets of the whole global batch are drawn from ``(seed, step)`` (cheap), but only the
    requested rows' bytes are gathered.
    """
    rng = np.random.default_rng([seed, step])
    starts = rng.integers(0, data.size - context, size=global_batch)[rows]
    idx = starts[:, None] + np.arange(context + 1)[None, :]
    return data[idx].astype(np.int32)
