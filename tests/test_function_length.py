"""No function in ``src/`` is longer than 80 lines unless its docstring says why (a sentence
starting "Long because"): long functions hide steps that deserve names."""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "fullshard"
MAX_LINES = 80


def long_functions(root: Path = SRC, limit: int = MAX_LINES) -> list[str]:
    """``path:line name (N lines)`` of every function over ``limit`` lines without a reason."""
    out = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            lines = (node.end_lineno or node.lineno) - node.lineno + 1
            if lines > limit and "Long because" not in (ast.get_docstring(node) or ""):
                out.append(f"{path.relative_to(root)}:{node.lineno} {node.name} ({lines} lines)")
    return out


def test_no_function_is_long_without_a_reason() -> None:
    assert long_functions() == [], "split these, or say in the docstring why they are long"


def test_a_long_function_is_found(tmp_path: Path) -> None:
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_LINES))
    (tmp_path / "m.py").write_text(
        f"def f():\n{body}\n\n\ndef g():\n    '''Long because.'''\n{body}\n"
    )
    assert long_functions(tmp_path) == [f"m.py:1 f ({MAX_LINES + 1} lines)"]


def test_no_function_passes_its_locals() -> None:
    """``locals()`` handed on (once a way to stay under the length limit) hides which
    arguments travel: name them."""
    calls = [
        f"{path.relative_to(SRC)}:{node.lineno}"
        for path in sorted(SRC.rglob("*.py"))
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Name)
        and node.func.id in ("locals", "vars")
        and not node.args
    ]
    assert calls == [], calls
