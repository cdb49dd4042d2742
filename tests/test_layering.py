"""Dependencies point one way: engine <- api <- checkpoint / memory / optim / fsdp1 <- train /
bench (which runs the FSDP1 wrapper as one of its modes).

Read from the source with ``ast`` (every ``import`` statement, including ones inside functions
and under ``TYPE_CHECKING``), so neither a lazy import nor a type-only one can hide an edge. A
module's layer is its first package below ``fullshard`` (``fullshard.bench.worker`` ->
``bench``, ``fullshard.engine.group`` -> ``engine``); the top-level modules outside the named
layers (``fullshard``, ``api``, ``module``, ``clip``, ``testing``) are ``api``; ``patch``
(which rebinds torch's FSDP1 class too) sits above ``fsdp1``, and the package's ``__init__``
(the facade of public names) may name ``fullshard.fsdp1``'s classes and the patch.
Within the engine no module imports another that imports it back, directly or not.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "src" / "fullshard"

#: layer -> the layers its modules may import from.
MAY_IMPORT: dict[str, set[str]] = {
    "engine": {"engine"},  # the engine knows nothing above it (fullshard/engine/__init__.py)
    "api": {"engine", "api"},  # fully_shard, FSDPModule, the patch, clipping, test helpers
    "models": set(),  # models never import fullshard: sharding is applied from outside
    "peers": {"engine", "api"},  # loads the benchmarks' fullshard_peers package by name
    "optim": {"engine", "api", "optim"},
    # RL post-training: weight sync, sleep/wake and rollouts through the engine and the API
    "rl": {"engine", "api", "rl"},
    "checkpoint": {"engine", "api", "checkpoint", "optim"},
    # FSDP1's API (FullyShardedDataParallel) on the engine: state dicts through checkpoint's
    # shard geometry
    "fsdp1": {"engine", "api", "checkpoint", "fsdp1"},
    "memory": {"engine", "api", "memory", "models", "peers"},
    "train": {"engine", "api", "train", "checkpoint", "memory", "models", "optim", "peers"},
    # bench runs fullshard's FSDP1 wrapper too (its fsdp1-fullshard mode)
    "bench": {
        "engine",
        "api",
        "bench",
        "checkpoint",
        "fsdp1",
        "memory",
        "models",
        "optim",
        "peers",
        "rl",
    },
    # `fullshard plan` (fullshard.memory.cli) speaks train's language (presets, config.toml):
    # a front-end at the tools' level; the planner itself (fullshard.memory) stays below train.
    "plan": {"engine", "api", "memory", "models", "peers", "train"},
    # patch_torch_fsdp(): rebinds torch's fully_shard and FSDP1 class to fullshard's
    "patch": {"engine", "api", "fsdp1"},
    # the package's __init__: the public names, FSDP1's wrapper among them (imported lazily)
    "facade": {"engine", "api", "fsdp1", "patch"},
    "cli": set(),  # dispatches to each tool by name (importlib), importing none of them
    "__main__": {"cli"},
}

#: The benchmarks' package that holds torch FSDP2's engine for the comparison tools
#: (``benchmarks/fullshard_peers``, shipped in the wheel beside ``fullshard``).
PEERS = Path(__file__).resolve().parents[1] / "benchmarks" / "fullshard_peers"
#: FSDP2's public *types*, which the library may import so that frameworks recognise its units
#: and accept torch's policy objects (nothing here runs torch's engine).
FSDP2_PUBLIC_TYPES = {
    "torch.distributed.fsdp",
    *(
        f"torch.distributed.fsdp.{name}"
        for name in (
            "FSDPModule",
            "UnshardHandle",
            "MixedPrecisionPolicy",
            "OffloadPolicy",
            "CPUOffloadPolicy",
            "DataParallelMeshDims",
        )
    ),
}
#: FSDP1's public types (the wrapper class for identity, its enums, dataclasses and state-dict
#: configs) and its wrap policies, which ``fullshard.fsdp1`` takes as user input; none of
#: torch's FSDP1 machinery (``FlatParameter``, ``_runtime_utils``, ``_state_dict_utils``,
#: ``_optim_utils``, ...) is imported.
FSDP1_PUBLIC_TYPES = {
    *(
        f"torch.distributed.fsdp.{name}"
        for name in (
            "FullyShardedDataParallel",
            "ShardingStrategy",
            "MixedPrecision",
            "CPUOffload",
            "BackwardPrefetch",
            "StateDictType",
            "StateDictConfig",
            "FullStateDictConfig",
            "ShardedStateDictConfig",
            "LocalStateDictConfig",
            "OptimStateDictConfig",
            "FullOptimStateDictConfig",
            "ShardedOptimStateDictConfig",
            "LocalOptimStateDictConfig",
            "StateDictSettings",
            "OptimStateKeyType",
        )
    ),
    "torch.distributed.fsdp.wrap",
    "torch.distributed.fsdp.wrap._Policy",
}


def _layer(module: str) -> str:
    """``fullshard.bench.worker`` -> ``bench``; ``fullshard.engine.hooks`` -> ``engine``;
    ``fullshard.api`` / ``fullshard`` -> ``api``."""
    if module == "fullshard.memory.cli":
        return "plan"
    if module == "fullshard.patch":
        return "patch"
    parts = module.split(".")
    if len(parts) > 1 and parts[1] in MAY_IMPORT:
        return parts[1]
    return "api"


def _module_name(path: Path) -> tuple[str, bool]:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    is_package = parts[-1] == "__init__"
    return ".".join(parts[:-1] if is_package else parts), is_package


def _is_submodule(package: str, name: str) -> bool:
    """Whether ``package.name`` is a module of this source tree (``from . import hooks``)."""
    if not package.startswith("fullshard"):
        return False
    base = PACKAGE.parent.joinpath(*package.split("."))
    return (base / f"{name}.py").exists() or (base / name / "__init__.py").exists()


def _imports(path: Path) -> list[tuple[int, str]]:
    """(line, absolute module name) for every import in ``path``; ``from a import b`` gives both
    ``a`` and ``a.b`` (``b`` may be a submodule, e.g. ``from fullshard import checkpoint``)."""
    name, is_package = _module_name(path)
    package = name.split(".") if is_package else name.split(".")[:-1]
    out: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            names = [a.name for a in node.names if a.name != "*"]
            if not names or not all(_is_submodule(module, n) for n in names):
                out.append((node.lineno, module))  # not only ``from package import submodule``
            out += [(node.lineno, f"{module}.{n}") for n in names]
    return out


def _sources() -> list[Path]:
    files = sorted(PACKAGE.rglob("*.py"))
    assert len(files) > 20, f"found only {len(files)} modules under {PACKAGE}"
    return files


def test_layer_rule_table_covers_the_tool_packages() -> None:
    subpackages = {p.parent.name for p in PACKAGE.glob("*/__init__.py")}
    assert subpackages <= set(MAY_IMPORT), subpackages - set(MAY_IMPORT)
    assert {"engine", "train", "bench", "memory", "checkpoint", "optim"} <= subpackages
    assert {"models", "peers"} <= {p.stem for p in PACKAGE.glob("*.py")}


def test_imports_point_one_way() -> None:
    bad = []
    for path in _sources():
        name, _ = _module_name(path)
        layer = "facade" if name == "fullshard" else _layer(name)
        for line, target in _imports(path):
            if target.split(".")[0] != "fullshard":
                continue
            to = _layer(target)
            if to != layer and to not in MAY_IMPORT[layer]:
                bad.append(f"{path.relative_to(PACKAGE.parent)}:{line} ({layer}) imports {target}")
    assert not bad, (
        "imports against the layering (engine <- checkpoint/memory/models/peers <- train/bench; "
        "see MAY_IMPORT in tests/test_layering.py):\n  " + "\n  ".join(sorted(set(bad)))
    )


ENGINE_SUBMODULES = {p.stem for p in (PACKAGE / "engine").glob("*.py") if p.stem != "__init__"} | {
    p.name for p in (PACKAGE / "engine").iterdir() if (p / "__init__.py").exists()
}


def _engine_submodules_named(path: Path) -> list[str]:
    """Where ``path`` imports an engine submodule by name: ``from ..engine.hooks import X``,
    ``import fullshard.engine.hooks``, ``from ..engine import hooks`` (what the AST gives as
    ``fullshard.engine.<submodule>``, the door's own names excluded)."""
    return [
        f"{path.relative_to(PACKAGE.parent)}:{line} imports {target}"
        for line, target in _imports(path)
        if target.startswith("fullshard.engine.") and target.split(".")[2] in ENGINE_SUBMODULES
    ]


def test_the_engine_is_entered_through_its_door() -> None:
    """Other packages import the engine's names from ``fullshard.engine`` (its ``__init__``,
    the door), never a submodule: what lies behind the door can change without rippling out."""
    assert {"hooks", "group", "collectives", "compat"} <= ENGINE_SUBMODULES
    bad = [
        hit
        for path in _sources()
        if "engine" not in path.relative_to(PACKAGE).parts[:1]
        for hit in _engine_submodules_named(path)
    ]
    assert not bad, (
        "import the engine's names from fullshard.engine (add a name to "
        "src/fullshard/engine/__init__.py if it is missing):\n  " + "\n  ".join(bad)
    )


def test_the_door_check_sees_each_form(tmp_path: Path) -> None:
    rel = PACKAGE / "rl" / "probe_door.py"
    forms = {
        "from ..engine.hooks import FSDPState": True,
        "import fullshard.engine.group": True,
        "from ..engine import hooks": True,
        "from fullshard.engine.collectives import count_collectives": True,
        "from ..engine import FSDPState, count_collectives": False,
        "from fullshard.engine import STATE_ATTR": False,
    }
    for source, refused in forms.items():
        rel.write_text(source + "\n")
        try:
            assert bool(_engine_submodules_named(rel)) is refused, source
        finally:
            rel.unlink()


def test_the_library_never_imports_torch_fsdp2s_engine() -> None:
    bad = [
        f"{path.relative_to(PACKAGE.parent)}:{line} imports {target}"
        for path in _sources()
        for line, target in _imports(path)
        if target.startswith("torch.distributed.fsdp")
        and target not in FSDP2_PUBLIC_TYPES | FSDP1_PUBLIC_TYPES
    ]
    assert not bad, (
        "the fullshard package may import FSDP2's and FSDP1's public types only; torch's "
        "engines are the "
        "benchmarks' peer (benchmarks/fullshard_peers):\n  " + "\n  ".join(bad)
    )


def test_the_fsdp2_peer_lives_in_the_benchmarks_package() -> None:
    """The comparison tools reach torch FSDP2 only through ``fullshard.peers``, by package name."""
    (init,) = PEERS.glob("__init__.py")
    targets = {
        f"{node.module}.{a.name}"
        for node in ast.walk(ast.parse(init.read_text()))
        if isinstance(node, ast.ImportFrom)
        for a in node.names
    }
    assert "torch.distributed.fsdp.fully_shard" in targets
    mentions = [p.name for p in _sources() if "fullshard_peers" in p.read_text()]
    assert mentions == ["peers.py"], mentions


@pytest.mark.parametrize(
    ("module", "layer"),
    [
        ("fullshard", "api"),
        ("fullshard.module", "api"),
        ("fullshard.engine.hooks", "engine"),
        ("fullshard.engine", "engine"),
        ("fullshard.optim.muon", "optim"),
        ("fullshard.bench.worker", "bench"),
        ("fullshard.models", "models"),
        ("fullshard.checkpoint", "checkpoint"),
        ("fullshard.fsdp1.wrapper", "fsdp1"),
        ("fullshard.patch", "patch"),
        ("fullshard.memory.planner", "memory"),
        ("fullshard.memory.cli", "plan"),
    ],
)
def test_layer_of(module: str, layer: str) -> None:
    assert _layer(module) == layer


def _engine_graph() -> dict[str, set[str]]:
    """Engine module -> the engine modules it imports (any import, any place in the file)."""
    engine = {_module_name(p)[0] for p in _sources() if _layer(_module_name(p)[0]) == "engine"}
    graph: dict[str, set[str]] = {}
    for path in _sources():
        name, _ = _module_name(path)
        if name in engine:
            graph[name] = {t for _, t in _imports(path) if t in engine and t != name}
    return graph


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of ``graph`` (as a path that returns to its start), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt) :] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_no_import_cycles_in_the_engine() -> None:
    graph = _engine_graph()
    assert len(graph) > 20 and "fullshard.engine.group" in graph
    cycle = _cycle(graph)
    assert cycle is None, (
        "engine modules import each other in a circle (type-only imports count): "
        + " -> ".join(cycle)
        + "; type the lower module by a Protocol of what it reads, or move the function"
    )


def test_the_cycle_finder_finds_a_cycle() -> None:
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None
