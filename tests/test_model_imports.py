"""seq2seq/model/ imports one way: no module reaches back to one that imports it, not even for type checking,
and no module reads attention weights from ambient state."""

from __future__ import annotations

import ast
from pathlib import Path

MODEL = Path(__file__).resolve().parents[1] / "seq2seq" / "model"
PACKAGE = "seq2seq.model."


def model_imports(path: Path) -> set[str]:
    """The seq2seq.model modules that `path` imports anywhere in it (TYPE_CHECKING blocks and functions too)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith(PACKAGE):
            found.add(node.module.removeprefix(PACKAGE).split(".")[0])
        elif isinstance(node, ast.Import):
            found.update(a.name.removeprefix(PACKAGE).split(".")[0] for a in node.names if a.name.startswith(PACKAGE))
    return found


def test_the_model_modules_import_one_way() -> None:
    graph = {path.stem: model_imports(path) for path in MODEL.glob("*.py") if path.stem != "__init__"}
    assert set(graph) >= {"attention", "cache", "layers", "plan", "record", "rnn", "transformer"}
    done: set[str] = set()

    def visit(module: str, path: tuple[str, ...]) -> None:
        assert module not in path, f"import circle: {' -> '.join((*path, module))}"
        if module in done:
            return
        for imported in sorted(graph.get(module, set())):
            visit(imported, (*path, module))
        done.add(module)

    for module in sorted(graph):
        visit(module, ())


def test_no_model_module_keeps_ambient_state() -> None:
    for path in MODEL.glob("*.py"):
        assert "ContextVar" not in path.read_text(), f"{path.name}: attention weights are asked for, not ambient"
