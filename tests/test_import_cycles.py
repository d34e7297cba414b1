"""No import circles between the project's modules.

Every import counts, wherever it sits: at the top, under `TYPE_CHECKING`, or inside a function (a
lazy import only hides a circle until someone moves it to the top). Two modules that need each
other share a piece that belongs below both (e.g. `router.sequence` under `router.dispatch` and
`router.pod_stream`; `cbserve.arg_types` under `cbserve.cli` and `cbserve.up`), or one takes the
other's part as a narrow Protocol or a callable (`decode_pod.session.OpenRequestFn`).

`engine/` counts too: its tensor-parallel worker builds its parts itself rather than importing the
engine that launches it, and `engine.decode_columns` takes the scheduler as its state
(`engine.scheduling.state.SchedulerState`, below both).
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("wire", "pod", "engine", "kernels", "kvtransfer", "prefill_pod", "decode_pod", "router", "cbserve")
CHECKED = PACKAGES


def _modules() -> dict[str, Path]:
    modules = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
            modules[name.removesuffix(".__init__")] = path
    return modules


def import_graph() -> dict[str, set[str]]:
    """module -> the project modules it imports (`from a.b import c` counts a.b.c when that is a
    module, else a.b)."""
    modules = _modules()

    def resolve(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    graph = {}
    for module, path in modules.items():
        deps = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [f"{node.module}.{alias.name}" for alias in node.names]
            else:
                continue
            deps |= {r for r in map(resolve, names) if r is not None}
        graph[module] = deps - {module}
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_the_circle_finder_finds_a_planted_circle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert circles(graph) == [["a", "b", "c"]]


def test_no_import_circles():
    found = [c for c in circles(import_graph()) if any(m.split(".")[0] in CHECKED for m in c)]
    assert found == [], f"import circles: {found}"
