"""The package's shape: no import cycle anywhere in src/paratrain, and imports at the top of files.
These rules are the library's: ``paratrain.testing`` (the helpers of the tests and benchmarks) is
outside them, and no module of the library may import it.

The import graph is built with ``ast`` from every module's imports of ``paratrain.*``, top-level
and function-level alike (a lazy import still closes a cycle when it runs). An edge goes to the
module imported (``from paratrain.a import b`` to ``paratrain.a.b`` when that is a module, else to
``paratrain.a``); the implicit import of parent packages is not an edge (``paratrain/__init__``
imports the trainer, so every module would trivially reach itself through it).
"""

from __future__ import annotations

import ast
import os
import runpy
import sys

import pytest

import paratrain
import paratrain.distributed.process_group
import paratrain.launch.worker

ROOT = os.path.dirname(paratrain.__file__)
TESTING = "paratrain.testing"


def _is_testing(module: str) -> bool:
    return module == TESTING or module.startswith(TESTING + ".")


def _modules(*, testing: bool = False) -> dict[str, str]:
    """The library's modules by name (with ``testing``: paratrain.testing's as well)."""
    out = {}
    for dirpath, _, files in os.walk(ROOT):
        for f in files:
            if f.endswith(".py"):
                path = os.path.join(dirpath, f)
                rel = os.path.relpath(path, os.path.dirname(ROOT))[:-3].replace(os.sep, ".")
                out[rel.removesuffix(".__init__")] = path
    return out if testing else {m: p for m, p in out.items() if not _is_testing(m)}


def _imports(path: str, name: str, modules: dict[str, str]) -> list[tuple[str, int, bool]]:
    """(imported module, line, at top level) for every import of a paratrain module in ``path``."""
    tree = ast.parse(open(path).read(), path)
    package = name if path.endswith("__init__.py") else name.rpartition(".")[0]
    top = {id(n) for n in tree.body}
    found = []
    for node in ast.walk(tree):
        targets = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
        for t in targets:
            if t.split(".")[0] == "paratrain":
                while t not in modules:  # `import paratrain.a.b` names a module; a.b may be an attribute
                    t = t.rpartition(".")[0]
                found.append((t, node.lineno, id(node) in top))
    return found


def _graph() -> dict[str, set[str]]:
    """The library's modules and what each imports (paratrain.testing's modules among the targets)."""
    modules = _modules(testing=True)
    return {m: {t for t, _, _ in _imports(p, m, modules) if t != m} for m, p in modules.items() if not _is_testing(m)}


def _imports_of_testing(graph: dict[str, set[str]]) -> list[tuple[str, str]]:
    return [(m, t) for m, ts in sorted(graph.items()) for t in sorted(ts) if _is_testing(t)]


def _find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1 = on the current path, 2 = done
    path: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        path.append(m)
        for t in sorted(graph.get(m, ())):
            if state.get(t) == 1:
                return path[path.index(t) :] + [t]
            if t not in state and (cycle := visit(t)):
                return cycle
        path.pop()
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state and (cycle := visit(m)):
            return cycle
    return None


def test_the_import_graph_of_the_package_has_no_cycle():
    graph = _graph()
    assert len(graph) > 30 and "paratrain.trainer" in graph
    cycle = _find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_the_library_never_imports_its_test_helpers():
    """paratrain.testing imports transformers, starts subprocess jobs and builds toy models: it serves
    the tests and the benchmarks, and a module of the library that imported it would ship all that.
    An injected import of it is found (the check can fail)."""
    graph = _graph()
    assert not _imports_of_testing(graph), f"the library imports paratrain.testing: {_imports_of_testing(graph)}"
    graph["paratrain.trainer"] = graph["paratrain.trainer"] | {"paratrain.testing.toy"}
    assert _imports_of_testing(graph) == [("paratrain.trainer", "paratrain.testing.toy")]


def test_the_cycle_finder_finds_a_cycle():
    # The test above must be able to fail: an injected back edge is found.
    graph = _graph()
    graph["paratrain.batch.plan"] = graph["paratrain.batch.plan"] | {"paratrain.trainer"}
    cycle = _find_cycle(graph)
    assert cycle is not None and cycle[0] == cycle[-1]


# The package's floors, bottom-up (docs/structure.md): a module imports only from its own room or
# from a lower floor (rooms that share a floor are siblings and import nothing of each other). A
# room is a root module or a package; every room must be placed, so a new one gets a floor.
LAYERS = (
    ("config", "preemption"),
    ("loss", "optim", "precision", "randomness"),
    ("objectives",),
    ("distributed", "data"),
    ("models", "checkpoint", "hardware", "step"),
    ("observability",),
    ("build",),  # its start-up line (observability/events.py startup)
    ("batch", "generate"),
    ("preflight", "evaluate"),
    ("plan", "trainer"),
    ("launch",),
    ("verify", "train", "paratrain"),
    ("cli",),
    ("__main__",),
)


def _room(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "paratrain"


def _upward(graph: dict[str, set[str]], layers=LAYERS) -> list[tuple[str, str]]:
    floor = {room: i for i, rooms in enumerate(layers) for room in rooms}
    return [
        (m, t)
        for m, ts in sorted(graph.items())
        for t in sorted(ts)
        if _room(t) != _room(m) and floor[_room(t)] >= floor[_room(m)]
    ]


def test_every_import_runs_down_the_floors():
    graph = _graph()
    placed = {room for rooms in LAYERS for room in rooms}
    assert {_room(m) for m in graph} <= placed, (
        f"rooms without a floor in LAYERS: { ({_room(m) for m in graph} - placed) }"
    )
    assert not _upward(graph), "imports running back up (or sideways): " + ", ".join(
        f"{m} -> {t}" for m, t in _upward(graph)
    )


def test_the_layering_test_finds_the_old_compile_arrow():
    """Before distributed/compile.py, ``compiling.py`` sat at the root: distributed/parallelize.py
    imported it and it imported distributed/data_parallel.py. Wherever that room is placed, one of
    the two arrows runs up (the cycle test could not see it: no module-level cycle)."""
    graph = _graph()
    graph["paratrain.distributed.parallelize"] = graph["paratrain.distributed.parallelize"] | {"paratrain.compiling"}
    graph["paratrain.compiling"] = {"paratrain.distributed.data_parallel"}
    for floor in range(len(LAYERS)):
        layers = tuple(rooms + (("compiling",) if i == floor else ()) for i, rooms in enumerate(LAYERS))
        assert _upward(graph, layers), f"the old compile arrow passes with compiling on floor {floor}"


def test_the_root_keeps_the_main_path():
    """At most 15 root modules (27 before the packages; randomness.py, which the data path and
    the step both use, is one; the parallel build is a package, build/, with its frozen models):
    the rest has a home per concern."""
    root = sorted(f for f in os.listdir(ROOT) if f.endswith(".py"))
    assert len(root) <= 15, root


def test_distributed_imports_no_model():
    """distributed/ gets the model's pieces (blocks, plan) as arguments (models/spec.py)."""
    graph = _graph()
    bad = {(m, t) for m, ts in graph.items() if m.startswith("paratrain.distributed") for t in ts}
    assert not {(m, t) for m, t in bad if t.startswith("paratrain.models")}


def test_preflight_and_plan_import_no_model_of_their_own():
    """The GPT's facts (heads, context length, experts, its FLOPs count) are its spec's answers
    (models/gpt/parallel.py GPT_SPEC): preflight/ and plan/ ask the spec, so a new model family
    needs no edit there."""
    graph = _graph()
    bad = {
        (m, t)
        for m, ts in graph.items()
        if m.startswith(("paratrain.preflight", "paratrain.plan"))
        for t in ts
        if t.startswith("paratrain.models.gpt")
    }
    assert not bad, bad


def test_the_trainer_imports_find_batch_never_the_reverse():
    graph = _graph()
    assert "paratrain.trainer" not in {t for m, ts in graph.items() if m.startswith("paratrain.batch") for t in ts}


@pytest.mark.parametrize("module", sorted(_modules()))
def test_paratrain_imports_sit_at_the_top_unless_a_comment_says_why(module):
    """A function-level import of a paratrain module needs a comment on its line or the line above."""
    modules = _modules()
    path = modules[module]
    lines = open(path).read().splitlines()
    lazy = [
        (t, line)
        for t, line, at_top in _imports(path, module, modules)
        if not at_top and "#" not in lines[line - 1] and not lines[line - 2].strip().startswith("#")
    ]
    assert not lazy, f"{path}: function-level imports without a comment saying why: {lazy}"


def test_the_train_alias_runs_the_worker_and_leaves_the_api_function(monkeypatch):
    """`-m paratrain.train` runs worker.main without binding the module as `paratrain.train`."""
    calls = []
    monkeypatch.setattr(paratrain.launch.worker, "main", lambda argv=None: calls.append(argv) or 0)
    monkeypatch.setattr(sys, "argv", ["paratrain.train", "cfg.toml"])

    def run_then_exit(main):  # the real one ends the process with os._exit: it would end pytest
        raise SystemExit(main())

    monkeypatch.setattr(paratrain.distributed.process_group, "run_then_exit", run_then_exit)
    with pytest.raises(SystemExit) as exit_info:
        runpy.run_module("paratrain.train", run_name="__main__", alter_sys=True)  # what `python -m` does
    assert exit_info.value.code == 0 and calls == [None]
    assert callable(paratrain.train) and paratrain.train is paratrain.trainer.train
    assert "paratrain.train" not in sys.modules
