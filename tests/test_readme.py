"""Every Python snippet in README.md and docs/*.md runs as written (the docs must stay true).

A snippet that cannot run in a test (rare: it needs a cluster or takes minutes) is marked by the
line ``<!-- not-run: why -->`` right above its opening fence; it is reported as skipped.
"""

import ast
import dataclasses
import glob
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONTINUES = "continues the first example"
# Pages being written on other branches; links to them are checked once they exist here.
OTHER_BRANCHES = {"docs/loss-contract.md", "docs/launching.md", "CONTRIBUTING.md"}
NOT_RUN = re.compile(r"<!-- not-run: (.+?) -->\n$")
DOCS = [
    "README.md",
    *sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "docs", "*.md"))),
]


def _read(name):
    with open(os.path.join(ROOT, name), encoding="utf-8") as f:
        return f.read()


def _snippets(name):
    text = _read(name)
    blocks = []
    for m in re.finditer(r"```python\n(.*?)```", text, re.S):
        line = text.count("\n", 0, m.start()) + 1
        skip = NOT_RUN.search(text, 0, m.start())
        marks = [pytest.mark.skip(reason=skip.group(1))] if skip else []
        blocks.append(pytest.param(name, m.group(1), id=f"{name}:{line}", marks=marks))
    return blocks


SNIPPETS = [s for name in DOCS for s in _snippets(name)]
FIRST = _snippets("README.md")[0].values[1]


def test_readme_has_snippets():
    assert len(_snippets("README.md")) >= 1
    assert len(SNIPPETS) >= 5


@pytest.mark.parametrize("name, code", SNIPPETS)
def test_snippet_runs(name, code, tmp_path, monkeypatch, request):
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
    exec(compile(code, name, "exec"), {"__name__": "readme"})


@pytest.mark.parametrize("name", DOCS)
def test_links_resolve(name):
    """Relative links point at files that exist; links into BENCHMARKS.md name an anchor it has
    (its sections carry ``<a id="bench_...">``, written by bench/run_all.py)."""
    text = _read(name)
    benchmarks = _read("BENCHMARKS.md")
    base = os.path.dirname(os.path.join(ROOT, name))
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"[a-z]+:", target) or target.startswith("#"):
            continue
        path, _, anchor = target.partition("#")
        full = os.path.normpath(os.path.join(base, path))
        if os.path.relpath(full, ROOT) in OTHER_BRANCHES:
            continue
        assert os.path.exists(full), f"{name}: link to missing {target}"
        if anchor and full == os.path.join(ROOT, "BENCHMARKS.md"):
            assert f'<a id="{anchor}"></a>' in benchmarks, f"{name}: no anchor {target}"


def test_ddpconfig_table_matches_the_dataclass():
    """docs/how-a-step-works.md lists every DDPConfig field once, with its default."""
    from jaxdp import DDPConfig

    text = _read("docs/how-a-step-works.md")
    rows = re.findall(r"^\| `(\w+)` \| `([^`]*)` \|", text, re.M)
    assert [f for f, _ in rows] == [f.name for f in dataclasses.fields(DDPConfig)]
    for f, default in rows:
        assert ast.literal_eval(default) == DDPConfig.__dataclass_fields__[f].default, f


def test_xla_flag_table_matches_xla_flags():
    """docs/gpu-and-xla-flags.md lists exactly the flags jaxdp.xla_flags emits for some config."""
    import jaxdp

    text = _read("docs/gpu-and-xla-flags.md")
    listed = set(re.findall(r"^\| `(xla_gpu_\w+)` \|", text, re.M))
    emitted = set()
    for stage, g, jaxlib in [(0, 1, None), (1, 4, None), (3, 1, None), (3, 4, "0.10.2")]:
        cfg = jaxdp.DDPConfig(zero_stage=stage, num_microbatches=g, param_dtype="bfloat16")
        kwargs = {"jaxlib_version": jaxlib} if jaxlib else {}
        for flag in jaxdp.xla_flags(cfg, dp_size=8, **kwargs):
            emitted.add(flag.removeprefix("--").split("=")[0])
    assert listed == emitted
