"""The engine's core is FSDP2's path; gloo's speed work lives in two plug-ins.

The core (the modules that gather, reduce, run the hooks and coordinate a step) calls the host
strategy (``fullshard.engine.host``) at named points and runs each unit's collectives through
the comms its transport holds (``fullshard.engine.transport``: ``fullshard.engine.p2p``'s on
gloo, none on CUDA). Read from the source with ``ast``: no identifier, attribute, argument,
import or string in a core module (docstrings and comments aside, which may point at a
plug-in's Notes) names a plug-in's concern, and no core module imports the plug-ins'
internals.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ENGINE = Path(__file__).resolve().parents[1] / "src" / "fullshard" / "engine"
CORE = ("gather", "reduce", "group", "hooks", "context", "order", "collectives")
#: the plug-ins' vocabulary: p2p exchanges, gathering in pieces, the buffer pool, gradient
#: slabs (lent memory), taking back a unit's own gathered memory, the small-unit window
CONCERNS = re.compile(r"p2p|pieces|pool|slab|lend|recycl|reclaim|window", re.IGNORECASE)
#: plug-in internals the core must not import (the host strategy is a plug-in's door)
INTERNALS = {"p2p", "pieces", "pool", "window"}


def _docstrings(tree: ast.AST) -> set[int]:
    ids = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                ids.add(id(body[0].value))
    return ids


def _words(source: str) -> list[tuple[int, str]]:
    """Every name the code itself uses, with its line: identifiers, attributes, definitions,
    arguments, keywords, imports and string literals that are not docstrings."""
    tree = ast.parse(source)
    skip = _docstrings(tree)
    out: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        line = getattr(node, "lineno", 0)
        if isinstance(node, ast.Name):
            out.append((line, node.id))
        elif isinstance(node, ast.Attribute):
            out.append((line, node.attr))
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out.append((line, node.name))
        elif isinstance(node, ast.arg):
            out.append((line, node.arg))
        elif isinstance(node, ast.keyword) and node.arg:
            out.append((line, node.arg))
        elif isinstance(node, ast.alias):
            out.append((line, node.asname or node.name))
        elif isinstance(node, ast.ImportFrom) and node.module:
            out.append((line, node.module))
        elif (
            isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in skip
        ):
            out.append((line, node.value))
    return out


def _concerns(source: str) -> list[tuple[int, str]]:
    return sorted({(line, w) for line, w in _words(source) if CONCERNS.search(w)})


def test_the_core_names_no_plugin_concern() -> None:
    found = []
    for name in CORE:
        text = (ENGINE / f"{name}.py").read_text()
        code = {line for line, _ in _concerns(text)}
        found += [f"engine/{name}.py:{line}: {w!r}" for line, w in _concerns(text)]
        found += [  # comments and docstrings too
            f"engine/{name}.py:{i}: {line.strip()}"
            for i, line in enumerate(text.splitlines(), 1)
            if i not in code and CONCERNS.search(line)
        ]
    assert not found, (
        "the engine's core names a plug-in's concern (move it behind the host strategy or the "
        "transport's comms):\n" + "\n".join(found)
    )


def test_the_core_imports_no_plugin_internals() -> None:
    found = []
    for name in CORE:
        tree = ast.parse((ENGINE / f"{name}.py").read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.level == 1:
                mods = [node.module] if node.module else [a.name for a in node.names]
                found += [f"engine/{name}.py imports .{m}" for m in mods if m in INTERNALS]
    assert not found, "\n".join(found)


def test_the_scanner_sees_each_form() -> None:
    source = '''"""A docstring about the pool is fine."""
from .pool import HostBufferPool
import slab_lib as lender
def f(window: int, *, reclaim=1) -> None:
    """Nor is one about pieces."""
    x.p2p_collectives
    g(recycle=True)
    y = "gathered in pieces"
    # a comment about the pool is fine
'''
    words = {w for _, w in _concerns(source)}
    assert words == {
        "pool",
        "HostBufferPool",
        "lender",
        "window",
        "reclaim",
        "p2p_collectives",
        "recycle",
        "gathered in pieces",
    }, words
