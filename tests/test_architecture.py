"""The house rules of CONTRIBUTING.md, read from the code: layers import only downward, no
private name crosses a package, the config is read in named places only, the variant
questions are answered in the plan, and tools stand on the public API."""

from __future__ import annotations

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]
PKG = ROOT / "jaxdp"
SRC = PKG / "_src"

#: The layer table: a package of ``jaxdp/_src`` imports only packages of a lower rank. Packages
#: of one rank are independent of each other.
LAYERS = {
    "config": 0,
    "platform": 1,
    "layout": 1,
    "core": 2,
    "topology": 2,
    "optim": 2,
    "forms": 3,
    "comm": 4,
    "zero3": 5,
    "strategy": 6,
    "engine": 7,
}

#: The only modules that know ``DDPConfig`` (CONTRIBUTING.md, "Where the config is read"): the
#: config package, the plan, the XLA-flag module, the engine and its checkpoints, and the public
#: adapters that take a config (``reduce_gradients`` / ``reduce_buckets``,
#: ``BucketLayout.from_params``).
CONFIG_READERS = {
    "config/config.py",
    "config/checks.py",
    "strategy/plan.py",
    "platform/xla_flags.py",
    "engine/engine.py",
    "engine/checkpoint.py",
    "comm/public.py",
    "layout/layout.py",
}

#: Where the ZeRO stage may be asked: the config's own checks, the plan, the layout rules it
#: reads, and the XLA flags (which the stage decides).
STAGE_READERS = {
    "config/config.py",
    "config/checks.py",
    "strategy/plan.py",
    "layout/layout.py",
    "platform/xla_flags.py",
}

#: The ``jaxdp._src`` packages each tool may use besides the public ``jaxdp`` names.
TOOL_ENTRIES = {
    "aot": {"platform"},  # the XLA options the engine's step compiles with
    "nn": {"core"},  # the accumulation-fusion context the kernels open
    "testing": {"core"},  # the loss contract the reference step follows
    "train": {"platform"},  # which XLA flags the installed jaxlib has (the NCCL timeout)
    "models": set(),
    "launch": set(),
}


def _src_modules() -> list[pathlib.Path]:
    return sorted(p for p in SRC.rglob("*.py") if p.name != "__init__.py")


def _rel(path: pathlib.Path) -> str:
    return path.relative_to(SRC).as_posix()


def _imports(path: pathlib.Path) -> list[tuple[str, list[str]]]:
    """``(absolute module, imported names)`` of every ``jaxdp`` import in ``path``."""
    pkg = list(path.relative_to(ROOT).with_suffix("").parts)[:-1]
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            names = [a.name for a in node.names]
            if node.level:
                base = pkg[: len(pkg) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            if mod == "jaxdp" or mod.startswith("jaxdp."):
                out.append((mod, names))
        elif isinstance(node, ast.Import):
            out.extend((a.name, []) for a in node.names if a.name.startswith("jaxdp"))
    return out


def _package(module: str) -> str | None:
    """The ``_src`` package of a dotted module name (``jaxdp._src.comm.reduce`` -> ``comm``)."""
    parts = module.split(".")
    return parts[2] if len(parts) > 2 and parts[:2] == ["jaxdp", "_src"] else None


def _home(module: str) -> tuple[str, ...]:
    """The package a module belongs to for the private-name rule: ``jaxdp._src.<pkg>`` inside
    the implementation, ``jaxdp.<tool>`` for a tool, ``jaxdp`` for the top level."""
    parts = tuple(module.split("."))
    return parts[:3] if parts[:2] == ("jaxdp", "_src") else parts[:2]


def test_every_package_is_in_the_layer_table():
    found = {p.name for p in SRC.iterdir() if p.is_dir() and not p.name.startswith("__")}
    assert found == set(LAYERS), found ^ set(LAYERS)


def test_packages_import_only_lower_layers():
    bad = []
    for path in _src_modules():
        own = path.relative_to(SRC).parts[0]
        for mod, _ in _imports(path):
            other = _package(mod)
            if other is None:
                bad.append(f"{_rel(path)} imports {mod}, above the implementation")
            elif other != own and LAYERS[other] >= LAYERS[own]:
                bad.append(f"{_rel(path)} ({own}, {LAYERS[own]}) -> {other} ({LAYERS[other]})")
    assert not bad, "\n".join(bad)


def test_no_private_name_crosses_a_package():
    bad = []
    for path in PKG.rglob("*.py"):
        here = ".".join(path.relative_to(ROOT).with_suffix("").parts)
        for mod, names in _imports(path):
            if _home(mod) == _home(here):
                continue
            bad += [f"{path.relative_to(ROOT)}: {mod}.{n}" for n in names if n.startswith("_")]
    assert not bad, "\n".join(bad)


def test_no_module_reaches_into_another_objects_private_attributes():
    """``x._name`` only on ``self``/``cls`` (NamedTuple's ``_replace`` is public API)."""
    bad = []
    for path in _src_modules():
        for node in ast.walk(ast.parse(path.read_text())):
            if not (isinstance(node, ast.Attribute) and node.attr.startswith("_")):
                continue
            if node.attr.startswith("__") or node.attr == "_replace":
                continue
            if isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
                continue
            bad.append(f"{_rel(path)}:{node.lineno}: {ast.unparse(node)}")
    assert not bad, "\n".join(bad)


def test_the_config_is_read_in_named_places_only():
    readers = set()
    for path in _src_modules():
        imports_config = any(_package(m) == "config" for m, _ in _imports(path))
        if "DDPConfig" in path.read_text() or imports_config:
            readers.add(_rel(path))
    assert readers == CONFIG_READERS, (readers - CONFIG_READERS, CONFIG_READERS - readers)
    assert len(readers) <= 8


def _branch_tests(tree: ast.AST) -> list[ast.expr]:
    tests: list[ast.expr] = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.If, ast.IfExp, ast.While)):
            tests.append(node.test)
        elif isinstance(node, ast.comprehension):
            tests.extend(node.ifs)
        elif isinstance(node, (ast.BoolOp, ast.Compare)):
            tests.append(node)
    return tests


def _asks(tests: list[ast.expr], attr: str) -> list[int]:
    return [
        t.lineno
        for t in tests
        if any(isinstance(n, ast.Attribute) and n.attr == attr for n in ast.walk(t))
    ]


def test_the_zero_stage_is_asked_in_the_plan():
    bad = []
    for path in _src_modules():
        if _rel(path) not in STAGE_READERS:
            bad += [
                f"{_rel(path)}:{n}"
                for n in _asks(_branch_tests(ast.parse(path.read_text())), "zero_stage")
            ]
    assert not bad, bad
    plan = ast.parse((SRC / "strategy" / "plan.py").read_text())
    assert _asks(_branch_tests(plan), "zero_stage")


def test_tools_stand_on_the_public_api():
    bad = []
    for tool, allowed in TOOL_ENTRIES.items():
        paths = [PKG / f"{tool}.py"] if (PKG / f"{tool}.py").exists() else []
        paths += sorted((PKG / tool).rglob("*.py")) if (PKG / tool).is_dir() else []
        assert paths, tool
        for path in paths:
            for mod, _ in _imports(path):
                other = _package(mod)
                if other is not None and other not in allowed:
                    bad.append(f"{path.relative_to(ROOT)} -> {mod}")
    assert not bad, "\n".join(bad)


def _graph() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for path in PKG.rglob("*.py"):
        mod = ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
        graph[mod] = {m for m, _ in _imports(path) if m != mod}
    return {m: {d for d in deps if d in graph and d != "jaxdp"} for m, deps in graph.items()}


def test_no_import_circles():
    graph = _graph()
    state: dict[str, int] = {}

    def visit(m: str, stack: list[str]) -> None:
        state[m] = 1
        for d in graph[m]:
            assert state.get(d) != 1, f"import circle: {' -> '.join([*stack, m, d])}"
            if d not in state:
                visit(d, [*stack, m])
        state[m] = 2

    for m in graph:
        if m not in state:
            visit(m, [])


def test_at_most_eight_floors_of_packages():
    """The longest chain of package imports in ``_src`` (its floors) is at most 8."""
    deps: dict[str, set[str]] = {p: set() for p in LAYERS}
    for path in _src_modules():
        own = path.relative_to(SRC).parts[0]
        for mod, _ in _imports(path):
            other = _package(mod)
            if other and other != own:
                deps[own].add(other)

    def floor(p: str) -> int:
        return 1 + max((floor(d) for d in deps[p]), default=0)

    assert max(floor(p) for p in LAYERS) <= 8


def test_the_layer_table_is_the_one_contributing_documents():
    """CONTRIBUTING.md's table of where things live is generated from the tree, in this
    file's layer order (``python scripts/contributing.py``)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "contributing", ROOT / "scripts" / "contributing.py"
    )
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert {p: r - 1 for p, r in mod.LAYERS.items()} == LAYERS
    assert mod.main(["--check"]) == 0, "run python scripts/contributing.py"


def test_figures_stay_out_of_the_library():
    """Measured GPU figures live in BENCHMARKS.md; docstrings keep the why (<= 5 mentions)."""
    hits = [
        f"{p.relative_to(ROOT)}:{i}"
        for p in PKG.rglob("*.py")
        for i, line in enumerate(p.read_text().splitlines(), 1)
        if "H100" in line or "H200" in line
    ]
    assert len(hits) <= 5, hits
