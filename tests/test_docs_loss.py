"""Every Python block in docs/loss-contract.md runs as written (the guide must stay true)."""

import os
import re

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GUIDE = os.path.join("docs", "loss-contract.md")


def _blocks():
    with open(os.path.join(ROOT, GUIDE), encoding="utf-8") as f:
        text = f.read()
    return [
        pytest.param(m.group(1), id=f"{GUIDE}:{text.count(chr(10), 0, m.start()) + 1}")
        for m in re.finditer(r"```python\n(.*?)```", text, re.S)
    ]


BLOCKS = _blocks()


def test_guide_has_blocks():
    assert len(BLOCKS) >= 6


@pytest.mark.parametrize("code", BLOCKS)
def test_block_runs(code, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # blocks that write files write them here
    exec(compile(code, GUIDE, "exec"), {"__name__": "guide"})
