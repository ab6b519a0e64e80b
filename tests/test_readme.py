"""Every Python snippet in README.md runs as written (the README must stay true)."""

import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONTINUES = "continues the first example"


def _snippets():
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        text = f.read()
    blocks = []
    for m in re.finditer(r"```python\n(.*?)```", text, re.S):
        line = text.count("\n", 0, m.start()) + 1
        blocks.append(pytest.param(m.group(1), id=f"README.md:{line}"))
    return blocks


SNIPPETS = _snippets()
FIRST = SNIPPETS[0].values[0]


def test_readme_has_snippets():
    assert len(SNIPPETS) >= 5


@pytest.mark.parametrize("code", SNIPPETS)
def test_snippet_runs(code, tmp_path, monkeypatch, request):
    if "apply_xla_flags" in code:
        # XLA reads its flags when the first backend starts: this one needs a fresh interpreter.
        env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
        r = subprocess.run(
            [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
        )
        assert r.returncode == 0, r.stderr[-3000:]
        return
    if "aot.h100_mesh" in code:
        request.getfixturevalue("h100")  # skips without the gpu-aot extra
    monkeypatch.chdir(tmp_path)  # snippets that write files write them here
    if CONTINUES in code:
        code = FIRST + code
    exec(compile(code, "README.md", "exec"), {"__name__": "readme"})
