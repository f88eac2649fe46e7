"""The shape of the package: no import circles, and no arrow pointing up a layer.

Layers, bottom up: the leaves (errors, atomic, distributed, metrics, training), `cache_schema/`
(the format; it knows nothing else of c2kd), `recmodel/` (the recommender LM; no data recipes,
no stages), `pipeline/` (data, SASRec, teacher, stage one) and `evaluate`, `student/` (stage two;
never the teacher's code), and on top `cli`, `demo`. Imports inside functions count too: a lazy
import that closes a circle is still a circle.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "c2kd"

# module prefix -> prefixes it must not import
FORBIDDEN = {
    "c2kd.cache_schema": ("c2kd.recmodel", "c2kd.pipeline", "c2kd.student", "c2kd.training", "c2kd.evaluate",
                          "c2kd.cli", "c2kd.demo", "c2kd.metrics", "c2kd.distributed"),
    "c2kd.recmodel": ("c2kd.pipeline", "c2kd.student", "c2kd.evaluate", "c2kd.training", "c2kd.cli", "c2kd.demo",
                      "c2kd.cache_schema"),
    "c2kd.pipeline": ("c2kd.student", "c2kd.cli", "c2kd.demo"),
    "c2kd.student": ("c2kd.pipeline.teacher", "c2kd.pipeline.cache_teacher", "c2kd.pipeline.shard_writers",
                     "c2kd.cli", "c2kd.demo"),
    "c2kd.training": ("c2kd.recmodel", "c2kd.pipeline", "c2kd.student", "c2kd.cache_schema", "c2kd.evaluate"),
    "c2kd.atomic": tuple(f"c2kd.{m}" for m in ("cache_schema", "recmodel", "pipeline", "student", "training",
                                                "evaluate", "cli", "demo", "deploy", "metrics", "distributed")),
    "c2kd.errors": ("c2kd.",),
    "c2kd.hardware": ("c2kd.",),  # a leaf: what the CPU is, read by the demo and the benchmarks
}


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


def test_no_arrow_points_up():
    wrong = []
    for module, imported in import_graph().items():
        for prefix, banned in FORBIDDEN.items():
            if module == prefix or module.startswith(prefix + "."):
                wrong += [f"{module} -> {t}" for t in sorted(imported) if any(t == b or t.startswith(b) for b in banned)]
    assert not wrong, "imports against the layering: " + ", ".join(wrong)


def test_the_graph_sees_real_imports():
    graph = import_graph()  # the test would pass vacuously if it saw nothing
    assert "c2kd.cache_schema.schema" in graph["c2kd.cache_schema.reader"]
    assert "c2kd.recmodel.model" in graph["c2kd.student.objective"]
    assert "c2kd.training" in graph["c2kd.student.cache_batches"]
