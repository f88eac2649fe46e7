"""The shape of the package: no import circles, and no arrow pointing up or sideways.

The rooms stand in layers, bottom up; a module imports only from its own room or from a lower
layer, never from a room beside it or above it. Stage one (`pipeline/`) and stage two (`student/`)
share a layer, so the student can never reach the teacher's code. Imports inside functions count
too: a lazy import that closes a circle is still a circle.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "c2kd"

# Bottom up. A room is a sub-package (`data`) or a top-level module (`training`); `c2kd` is the
# package's own `__init__`.
LAYERS: list[tuple[str, ...]] = [
    ("c2kd", "errors", "hardware", "heap"),             # leaves
    ("atomic", "distributed", "cli_util"),              # files, processes, option parsing
    ("metrics", "training", "run_folder"),              # the training loop and its run folder
    ("cache_schema", "data", "recmodel", "predictions"),  # the cache format, the examples, the LM, per-example results
    ("sasrec", "evaluate", "compare"),                  # the baseline; evaluation of any model; paired comparison
    ("finetune", "pipeline", "student", "deploy", "latency"),  # train-teacher, stage one, stage two, export
    ("demo",),
    ("cli",),
]


def room(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def layer_of(module: str) -> int:
    name = room(module)
    for level, rooms in enumerate(LAYERS):
        if name in rooms:
            return level
    raise AssertionError(f"{module} is in no room of LAYERS: place it there")


def _modules() -> dict[str, Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


def import_graph() -> dict[str, set[str]]:
    """Module -> the c2kd modules it imports (a `from pkg import sub` names the submodule)."""
    modules = _modules()
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        is_package = path.name == "__init__.py"
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            targets = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = name.split(".") if is_package else name.split(".")[:-1]
                    anchor = anchor[: len(anchor) - node.level + 1]
                    base = ".".join([*anchor, base] if base else anchor)
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
            graph[name].update(t for t in targets if t in modules and t != name)
    return graph


def test_no_import_circles():
    graph = import_graph()
    state: dict[str, int] = {}
    cycles = []

    def visit(node: str, stack: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                cycles.append(stack[stack.index(nxt):] + [nxt] if nxt in stack else [node, nxt])
            elif nxt not in state:
                visit(nxt, [*stack, nxt])
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])
    assert not cycles, "import circles: " + "; ".join(" -> ".join(c) for c in cycles)


def test_every_module_has_a_room():
    for module in import_graph():
        layer_of(module)


def test_no_arrow_points_up_or_sideways():
    wrong = []
    for module, imported in import_graph().items():
        for target in sorted(imported):
            same_room = room(module) == room(target)
            if not same_room and layer_of(target) >= layer_of(module):
                wrong.append(f"{module} -> {target}")
    assert not wrong, "imports against the layering: " + ", ".join(wrong)


def test_a_forbidden_arrow_is_caught():
    # The check itself: stage two reaching stage one, or the format reaching the model, would fail.
    assert layer_of("c2kd.pipeline.cache_teacher") >= layer_of("c2kd.student.distill")
    assert layer_of("c2kd.recmodel.model") >= layer_of("c2kd.cache_schema.reader")
    assert layer_of("c2kd.evaluate") > layer_of("c2kd.data.examples")


def test_the_graph_sees_real_imports():
    graph = import_graph()  # the test would pass vacuously if it saw nothing
    assert "c2kd.cache_schema.schema" in graph["c2kd.cache_schema.reader"]
    assert "c2kd.recmodel.model" in graph["c2kd.student.objective"]
    assert "c2kd.training" in graph["c2kd.student.cache_batches"]
