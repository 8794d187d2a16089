"""The package's import direction (docs/ARCHITECTURE.md): each layer imports only the layers below it.

The scan reads every module's import statements (absolute and relative) without importing anything, so a layering
break is caught on any machine, including imports inside functions.
"""
import ast
from pathlib import Path
from typing import Dict, Set

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "tlt_kernels"

# Who may import whom: a subpackage (or top-level module) of tlt_kernels -> the ones it may import.
HELPERS = {"_backend", "_switches", "_validation", "tree", "rng"}
ALLOWED: Dict[str, Set[str]] = {
    "_switches": set(),
    "_validation": set(),
    "_backend": {"_switches"},
    "rng": {"_backend", "_validation"},
    "tree": {"_backend", "_validation"},
    "reference": HELPERS,
    "_triton": HELPERS | {"reference"},
    "_cuda": HELPERS | {"reference"},
    "ops": HELPERS | {"reference", "_triton", "_cuda"},
    "runtime": HELPERS | {"ops", "reference"},
    "models": HELPERS | {"ops", "reference"},
    "drafter": HELPERS | {"ops", "reference", "models", "runtime"},
    "engine": HELPERS | {"ops", "reference", "models", "runtime", "drafter"},
    "integrations": HELPERS | {"ops", "reference", "models", "runtime", "drafter", "engine"},
}


def _layer(path: Path) -> str:
    parts = path.relative_to(PACKAGE).with_suffix("").parts
    return parts[0]


def _imported(path: Path):
    """The tlt_kernels modules ``path`` imports, as dotted names."""
    module = ["tlt_kernels", *path.relative_to(PACKAGE).with_suffix("").parts]
    package = module if path.name == "__init__.py" else module[:-1]
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level == 0:
                yield node.module or ""
                continue
            base = package[: len(package) - (node.level - 1)]
            if node.module:
                yield ".".join(base + [node.module])
            else:
                yield from (".".join(base + [alias.name]) for alias in node.names)


def _modules():
    return sorted(p for p in PACKAGE.rglob("*.py") if p.name != "__init__.py" or p.parent != PACKAGE)


@pytest.mark.parametrize("path", _modules(), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_imports_go_down_the_layers(path):
    layer = _layer(path)
    assert layer in ALLOWED, f"{layer} is a new layer: add it to ALLOWED here and to docs/ARCHITECTURE.md"
    for name in _imported(path):
        parts = name.split(".")
        if parts[0] == "bench":
            pytest.fail(f"{path.name} imports {name}: the package never imports the benchmark")
        if parts[0] != "tlt_kernels" or len(parts) < 2 or parts[1] == layer:
            continue
        assert parts[1] in ALLOWED[layer], f"{path.relative_to(PACKAGE)} imports {name}: {layer} may import only {sorted(ALLOWED[layer])}"


def test_the_scan_sees_relative_imports():
    """Not blind: the ops package's relative imports of its backends are found."""
    names = set(_imported(PACKAGE / "ops" / "verify_tree.py"))
    assert any(n.startswith("tlt_kernels.reference") for n in names), names
    assert any(n.startswith("tlt_kernels._backend") for n in names), names
