"""Count the runtime branch sites on each variant question in ``jaxdp/`` (an AST pass).

A *site* is an ``if`` statement, a conditional expression or a comprehension filter whose test
names one of a question's markers (below). Validation is not counted: a branch whose body only
raises or warns. Prints one line per question: sites, files, and the sites per file.

    python bench/branch_sites.py            # the whole package
    python bench/branch_sites.py --where    # also every site as file:line
"""

from __future__ import annotations

import argparse
import ast
import collections
import pathlib

QUESTIONS = {
    "ZeRO stage": {
        "zero_stage",
        "sharded",
        "shards_params",
        "zero3",
        "deferred",
        "use_distributed_optimizer",
        "_sharded",
    },
    "multi-axis mesh": {"_multi", "trivial", "expert_axis", "groups", "auto_axes", "manual_axes"},
    "scan stacks": {"stacked", "scan_layers", "stack_of"},
    "layout kind": {"kind", "gathers_per_parameter"},
}


def _names(node: ast.AST) -> set[str]:
    out = set()
    for n in ast.walk(node):
        if isinstance(n, ast.Name):
            out.add(n.id)
        elif isinstance(n, ast.Attribute):
            out.add(n.attr)
    return out


def _only_raises(body: list[ast.stmt]) -> bool:
    for st in body:
        if isinstance(st, ast.Raise):
            continue
        if isinstance(st, ast.Expr) and isinstance(st.value, ast.Call):
            f = st.value.func
            if isinstance(f, ast.Attribute) and f.attr == "warn":
                continue
        return False
    return bool(body)


def sites(root: pathlib.Path) -> dict[str, list[tuple[str, int]]]:
    found: dict[str, list[tuple[str, int]]] = collections.defaultdict(list)
    for path in sorted(root.rglob("*.py")):
        tree = ast.parse(path.read_text())
        rel = str(path.relative_to(root.parent))
        for node in ast.walk(tree):
            tests = []
            if (isinstance(node, ast.If) and not _only_raises(node.body)) or isinstance(
                node, ast.IfExp
            ):
                tests.append(node.test)
            elif isinstance(node, ast.comprehension):
                tests.extend(node.ifs)
            for t in tests:
                names = _names(t)
                for q, markers in QUESTIONS.items():
                    if names & markers:
                        found[q].append((rel, t.lineno))
    return found


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--where", action="store_true", help="list every site")
    ap.add_argument("--root", default=str(pathlib.Path(__file__).resolve().parents[1] / "jaxdp"))
    args = ap.parse_args()
    found = sites(pathlib.Path(args.root))
    for q in QUESTIONS:
        s = found.get(q, [])
        per = collections.Counter(f for f, _ in s)
        print(
            f"{q}: {len(s)} sites in {len(per)} files  "
            + ", ".join(f"{f.removeprefix('jaxdp/')} {n}" for f, n in per.most_common())
        )
        if args.where:
            for f, line in s:
                print(f"    {f}:{line}")


if __name__ == "__main__":
    main()
