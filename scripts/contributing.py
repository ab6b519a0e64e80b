"""Regenerate the "Where things live" table of CONTRIBUTING.md from the tree.

Each package of ``jaxdp/_src`` (in layer order) and each tool, with its modules and the first
line of each module's docstring, between the markers ``<!-- where:begin -->`` and
``<!-- where:end -->``::

    python scripts/contributing.py          # rewrite CONTRIBUTING.md
    python scripts/contributing.py --check  # exit 1 if it is out of date (tests run this)
"""

from __future__ import annotations

import argparse
import ast
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
DOC = ROOT / "CONTRIBUTING.md"
BEGIN, END = "<!-- where:begin -->", "<!-- where:end -->"
#: Packages of jaxdp/_src and their layers, lowest first (tests/test_architecture.py checks them).
LAYERS = {
    "config": 1,
    "platform": 2,
    "layout": 2,
    "core": 3,
    "topology": 3,
    "optim": 3,
    "forms": 4,
    "comm": 5,
    "zero3": 6,
    "strategy": 7,
    "engine": 8,
}
TOOLS = ("aot", "launch", "models", "nn", "testing", "train")


def _summary(path: pathlib.Path) -> str:
    doc = ast.get_docstring(ast.parse(path.read_text())) or ""
    first = doc.strip().split("\n\n")[0].replace("\n", " ")
    return first.replace("|", "\\|")


def _rows(folder: pathlib.Path) -> list[str]:
    files = [folder] if folder.suffix == ".py" else sorted(folder.glob("*.py"))
    out = []
    for f in files:
        bare = not ast.get_docstring(ast.parse(f.read_text()))
        if f.name == "__init__.py" and folder.suffix != ".py" and len(files) > 1 and bare:
            continue
        out.append(f"| `{f.relative_to(ROOT).as_posix()}` | {_summary(f)} |")
    return out


def table() -> str:
    lines = ["| file | what it is for |", "| --- | --- |"]
    for pkg, layer in LAYERS.items():
        lines.append(f"| **`jaxdp/_src/{pkg}/`** | layer {layer} of the implementation |")
        lines += _rows(ROOT / "jaxdp" / "_src" / pkg)
    for tool in TOOLS:
        path = ROOT / "jaxdp" / tool
        path = path if path.is_dir() else path.with_suffix(".py")
        if path.exists():
            lines.append(f"| **`jaxdp/{tool}`** | tool on the public API |")
            lines += _rows(path)
    return "\n".join(lines)


def render(text: str) -> str:
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    return f"{head}{BEGIN}\n{table()}\n{END}{tail}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    ap.add_argument("--check", action="store_true", help="exit 1 if CONTRIBUTING.md is stale")
    args = ap.parse_args(argv)
    text = DOC.read_text()
    new = render(text)
    if args.check:
        if new != text:
            print("CONTRIBUTING.md is out of date: run python scripts/contributing.py")
            return 1
        return 0
    DOC.write_text(new)
    return 0


if __name__ == "__main__":
    sys.exit(main())
