"""The package's shape (docs/DESIGN.md): a module imports only from its own layer and the ones before
it (imports inside functions count too), the modules of one layer import each other without a
cycle, and every module and function fits in a head."""
from __future__ import annotations

import ast
from pathlib import Path

import captioner

PACKAGE = Path(captioner.__file__).parent
LAYERS: list[tuple[str, ...]] = [
    ("captioner.errors", "captioner.files", "captioner.device", "captioner.config"),  # base
    ("captioner.data",),
    ("captioner.model",),
    ("captioner.decoding",),
    ("captioner.training",),
    ("captioner.deploy",),
    ("captioner.pictures",),
    ("captioner.recipes",),
    ("captioner.serve",),
    ("captioner.cli",),
]
MAX_LINES = 300  # a module
MAX_FUNCTION_LINES = 60  # a function or method, from its `def` to its last line


def layer_of(module: str) -> int | None:
    """Index in LAYERS of a module name (None: not a layered module, e.g. `captioner` itself)."""
    for i, prefixes in enumerate(LAYERS):
        if any(module == p or module.startswith(p + ".") for p in prefixes):
            return i
    return None


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _names(node: ast.AST) -> set[str]:
    """The captioner modules (and `module.name`s) one import statement names."""
    if isinstance(node, ast.Import):
        names = {a.name for a in node.names}
    elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
        names = {node.module} | {f"{node.module}.{a.name}" for a in node.names}  # `from captioner import train`
    else:
        names = set()
    return {n for n in names if n.startswith("captioner.")}


def imported(path: Path) -> set[str]:
    """Every captioner module a file imports, at the top or inside a function."""
    return {n for node in ast.walk(ast.parse(path.read_text(), str(path))) for n in _names(node)}


def imported_at_import(path: Path) -> set[str]:
    """The captioner modules importing `path` imports: its statements outside functions, what runs
    when it is imported (a function's imports run when it is called)."""
    found: set[str] = set()
    todo: list[ast.AST] = [ast.parse(path.read_text(), str(path))]
    while todo:
        node = todo.pop()
        found |= _names(node)
        todo += [c for c in ast.iter_child_nodes(node)
                 if not isinstance(c, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))]
    return found


def violations(files: list[Path]) -> list[str]:
    found = []
    for path in files:
        own = layer_of(module_name(path))
        for name in sorted(imported(path)):
            other = layer_of(name)
            if own is not None and other is not None and other > own:
                found.append(f"{module_name(path)} (layer {own}) imports {name} (layer {other})")
    return found


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The import cycles of `graph` (module -> the modules it imports), each once: [a, b, ..., a]."""
    found, done = [], set()

    def visit(node: str, path: list[str]) -> None:
        if node in path:
            cycle = path[path.index(node):]
            start = cycle.index(min(cycle))
            found.append(cycle[start:] + cycle[:start] + [min(cycle)])
            return
        if node in done:
            return
        for other in sorted(graph.get(node, ())):
            visit(other, [*path, node])
        done.add(node)

    for node in sorted(graph):
        visit(node, [])
    return sorted({tuple(c): c for c in found}.values())


def import_graph(files: list[Path]) -> dict[str, set[str]]:
    """module -> the package's modules it imports at import time, within its own layer (`from
    package import module` imports both the package's `__init__` and the module)."""
    modules = {module_name(f) for f in files}
    graph = {}
    for path in files:
        own = module_name(path)
        names = {n for n in imported_at_import(path) if n in modules}
        graph[own] = {n for n in names if n != own and layer_of(n) == layer_of(own)}
    return graph


def long_functions(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(), str(path))
    return [f"{module_name(path)}.{node.name}: {node.end_lineno - node.lineno + 1} lines" for node in ast.walk(tree)
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
            and node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES]


def test_no_module_imports_from_a_later_layer():
    files = sorted(PACKAGE.rglob("*.py"))
    assert all(layer_of(module_name(f)) is not None for f in files if f.parent != PACKAGE or f.stem != "__init__")
    assert violations(files) == []


def test_the_check_catches_a_late_import(tmp_path, monkeypatch):
    fake = PACKAGE / "data" / "_late_import_probe.py"
    assert not fake.exists()
    source = "def f():\n    from captioner.training.loop import train_one_epoch\n    return train_one_epoch\n"
    monkeypatch.setattr(Path, "read_text", lambda self, *a, **k: source if self == fake else Path.open(self).read())
    assert violations([fake]) == [
        "captioner.data._late_import_probe (layer 1) imports captioner.training.loop (layer 4)",
        "captioner.data._late_import_probe (layer 1) imports captioner.training.loop.train_one_epoch (layer 4)",
    ]


def test_no_import_cycle_within_a_layer():
    assert cycles(import_graph(sorted(PACKAGE.rglob("*.py")))) == []


def test_the_cycle_check_finds_a_cycle_and_ignores_imports_inside_functions(tmp_path):
    (tmp_path / "captioner" / "data").mkdir(parents=True)
    sources = {"a": "from captioner.data.b import x\n", "b": "import captioner.data.c\nx = 1\n",
               "c": "from captioner.data import a\n", "d": "def f():\n    from captioner.data import e\n",
               "e": "from captioner.data.d import f\n", "__init__": ""}
    for name, source in sources.items():
        (tmp_path / "captioner" / "data" / f"{name}.py").write_text(source)
    files = sorted((tmp_path / "captioner" / "data").glob("*.py"))
    graph = {module_name(PACKAGE / "data" / f.name): imported_at_import(f) for f in files}
    assert cycles({m: {n for n in names if n in graph} for m, names in graph.items()}) == [
        ["captioner.data.a", "captioner.data.b", "captioner.data.c", "captioner.data.a"]]
    assert cycles({"x": {"y"}, "y": {"x"}, "z": {"z"}}) == [["x", "y", "x"], ["z", "z"]]


def test_modules_and_functions_fit_in_a_head():
    files = sorted(PACKAGE.rglob("*.py"))
    long = {module_name(f): n for f in files
            if (n := len(f.read_text().splitlines())) > MAX_LINES}
    assert long == {}
    assert [line for f in files for line in long_functions(f)] == []
