"""The package's layers, in the order data flows: a module imports only from its own layer and the
ones before it (docs/DESIGN.md). Imports inside functions count too."""
from __future__ import annotations

import ast
from pathlib import Path

import captioner

PACKAGE = Path(captioner.__file__).parent
LAYERS: list[tuple[str, ...]] = [
    ("captioner.errors", "captioner.files", "captioner.runtime", "captioner.config"),  # base
    ("captioner.data",),
    ("captioner.model",),
    ("captioner.decoding",),
    ("captioner.deploy",),
    ("captioner.training",),
    ("captioner.pictures",),
    ("captioner.recipes",),
    ("captioner.serve",),
    ("captioner.cli",),
]
MAX_LINES = 350


def layer_of(module: str) -> int | None:
    """Index in LAYERS of a module name (None: not a layered module, e.g. `captioner` itself)."""
    for i, prefixes in enumerate(LAYERS):
        if any(module == p or module.startswith(p + ".") for p in prefixes):
            return i
    return None


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported(path: Path) -> set[str]:
    """Every captioner module a file imports, at the top or inside a function."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names.update(f"{node.module}.{a.name}" for a in node.names)  # `from captioner import train`
    return {n for n in names if n.startswith("captioner.")}


def violations(files: list[Path]) -> list[str]:
    found = []
    for path in files:
        own = layer_of(module_name(path))
        for name in sorted(imported(path)):
            other = layer_of(name)
            if own is not None and other is not None and other > own:
                found.append(f"{module_name(path)} (layer {own}) imports {name} (layer {other})")
    return found


def test_no_module_imports_from_a_later_layer():
    files = sorted(PACKAGE.rglob("*.py"))
    assert all(layer_of(module_name(f)) is not None for f in files if f.parent != PACKAGE or f.stem != "__init__")
    assert violations(files) == []


def test_the_check_catches_a_late_import(tmp_path, monkeypatch):
    fake = PACKAGE / "data" / "_late_import_probe.py"
    assert not fake.exists()
    source = "def f():\n    from captioner.training.loop import train\n    return train\n"
    monkeypatch.setattr(Path, "read_text", lambda self, *a, **k: source if self == fake else Path.open(self).read())
    assert violations([fake]) == [
        "captioner.data._late_import_probe (layer 1) imports captioner.training.loop (layer 5)",
        "captioner.data._late_import_probe (layer 1) imports captioner.training.loop.train (layer 5)",
    ]


def test_modules_fit_in_a_head():
    long = {module_name(f): n for f in PACKAGE.rglob("*.py") if (n := len(f.read_text().splitlines())) > MAX_LINES}
    assert long == {}
