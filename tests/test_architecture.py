"""The house rules of README "Architecture", read from the code: the step's straight line has
no branch on a variant question, imports run downward (no circles), modules stay small."""

import ast
import importlib.util
import os
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]
PKG = ROOT / "jaxdp"


def _branch_sites():
    spec = importlib.util.spec_from_file_location(
        "branch_sites", ROOT / "bench" / "branch_sites.py"
    )
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.sites(PKG)


def test_step_body_has_no_branch_on_stage_mesh_or_stacks():
    """The step (engine, local gradients, kernels, strategies) and the modules that ask the
    strategy (checkpoints) decide nothing: the plan did."""
    straight = {"_engine.py", "_local.py", "_kernels.py", "_strategy.py", "_checkpoint.py"}
    found = _branch_sites()
    for question in ("ZeRO stage", "multi-axis mesh", "scan stacks"):
        hits = [(f, line) for f, line in found.get(question, []) if os.path.basename(f) in straight]
        assert not hits, (question, hits)
    # ... and the plan is where they are decided.
    assert any(f.endswith("_plan.py") for f, _ in found["ZeRO stage"])


def _imports(path: pathlib.Path) -> set[str]:
    mod = ".".join(path.relative_to(ROOT).with_suffix("").parts)
    pkg = mod.rsplit(".", 1)[0] if path.name != "__init__.py" else mod
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level:
            base = pkg.split(".")
            base = base[: len(base) - node.level + 1]
            name = ".".join(base + ([node.module] if node.module else []))
            out.add(name)
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("jaxdp"):
            out.add(node.module)
    return out


def test_no_import_circles():
    graph = {}
    for path in PKG.rglob("*.py"):
        mod = ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
        graph[mod] = {m for m in _imports(path) if m != mod}
    graph = {m: {d for d in deps if d in graph and d != "jaxdp"} for m, deps in graph.items()}
    state: dict[str, int] = {}

    def visit(m, stack):
        state[m] = 1
        for d in graph[m]:
            assert state.get(d) != 1, f"import circle: {' -> '.join([*stack, m, d])}"
            if d not in state:
                visit(d, [*stack, m])
        state[m] = 2

    for m in graph:
        if m not in state:
            visit(m, [])


def test_modules_stay_small():
    sizes = {p.name: len(p.read_text().splitlines()) for p in PKG.rglob("*.py")}
    assert max(sizes.values()) <= 420, sorted(sizes.items(), key=lambda kv: -kv[1])[:3]
