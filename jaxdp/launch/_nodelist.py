"""SLURM's compressed host lists (``node[01-04,07],gpu-[1-3]-x``), expanded."""

from __future__ import annotations

import re

__all__ = ["expand_nodelist"]


def expand_nodelist(nodelist: str) -> list[str]:
    """SLURM's compressed host list, expanded.

    Example:
        >>> expand_nodelist("node[01-03,07],gpu-[1-2]-x")
        ['node01', 'node02', 'node03', 'node07', 'gpu-1-x', 'gpu-2-x']
    """
    hosts: list[str] = []
    depth, start = 0, 0
    for i, ch in enumerate(nodelist + ","):
        depth += (ch == "[") - (ch == "]")
        if depth < 0:
            raise ValueError(f"unbalanced ']' in {nodelist!r}")
        if ch == "," and depth == 0:
            item = nodelist[start:i].strip()
            if item:
                hosts += _expand_one(item)
            start = i + 1
    if depth:
        raise ValueError(f"unbalanced '[' in {nodelist!r}")
    return hosts


def _expand_one(item: str) -> list[str]:
    m = re.search(r"\[([^\]]*)\]", item)
    if m is None:
        return [item]
    head, tail = item[: m.start()], item[m.end() :]
    out = []
    for r in m.group(1).split(","):
        lo, dash, hi = r.strip().partition("-")
        if not lo.isdigit() or (dash and not hi.isdigit()):
            raise ValueError(f"bad range {r!r} in {item!r}")
        width = len(lo)
        for k in range(int(lo), int(hi if dash else lo) + 1):
            out += _expand_one(f"{head}{k:0{width}d}{tail}")
    return out
