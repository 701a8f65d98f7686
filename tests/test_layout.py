"""The house's rules, read from the source: no import cycle in the library, ``stages`` built on
``pipeline`` and never the reverse, the library never importing its application (``_cli``), a
handful of modules directly in ``pipeline/`` and the rest in rooms, each room saying what it is
for, span names only in ``pipeline/tracing.py``."""

from __future__ import annotations

import ast
import importlib
import re
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
ROOMS = ("agent", "dropin", "results", "store", "testing", "tokens", "transcript", "wire")


def _modules(package: str) -> dict[str, Path]:
    out = {}
    for path in sorted((REPO / package).rglob("*.py")):
        parts = path.relative_to(REPO).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


def _imports(path: Path) -> Iterator[tuple[str, bool]]:
    """Each module ``path`` imports, and whether at run time (not under ``TYPE_CHECKING``)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    typing_only: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and getattr(node.test, "id", None) == "TYPE_CHECKING":
            typing_only.update(id(n) for n in ast.walk(node))
    for node in ast.walk(tree):
        runtime = id(node) not in typing_only
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            yield node.module, runtime
            for alias in node.names:
                yield f"{node.module}.{alias.name}", runtime
        elif isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, runtime


LIBRARY = {**_modules("pipeline"), **_modules("stages")}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            part = []
            while True:
                w = stack.pop()
                on.discard(w)
                part.append(w)
                if w == v:
                    break
            if len(part) > 1:
                found.append(sorted(part))

    # deep enough for any import chain, and given back: a test after this one in the same
    # process counts on the interpreter's own limit
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(max(limit, 10_000))
    try:
        for v in graph:
            if v not in index:
                visit(v)
    finally:
        sys.setrecursionlimit(limit)
    return found


def test_no_module_of_the_library_imports_itself_back() -> None:
    """Lazy imports (inside a function) count: a cycle broken by deferring an import is still
    a cycle. Imports for type checking only do not."""
    graph = {
        name: {m for m, runtime in _imports(path) if runtime and m in LIBRARY and m != name}
        for name, path in LIBRARY.items()
    }
    assert _cycles(graph) == []


@pytest.mark.parametrize("name", sorted(LIBRARY))
def test_each_module_imports_alone(name: str) -> None:
    """Whatever imports a module first, it loads (no order between modules matters)."""
    if name.startswith("pipeline.dropin.proxy") or name.startswith("pipeline._cli.proxy"):
        pytest.importorskip("starlette")
    code = f"import {name}"
    result = __import__("subprocess").run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr[-2000:]


def test_stages_build_on_pipeline_and_the_library_never_on_its_application() -> None:
    application = ("pipeline._cli", "pipeline.__main__")  # the command line composes both
    for name, path in LIBRARY.items():
        if name.startswith(application):
            continue
        imported = {m for m, _ in _imports(path)}
        if name.startswith("pipeline"):
            assert not any(m == "stages" or m.startswith("stages.") for m in imported), name
        assert not any(m.startswith("pipeline._cli") for m in imported), name


def test_pipeline_holds_a_handful_of_modules_and_rooms_that_say_what_they_hold() -> None:
    top = sorted(p.name for p in (REPO / "pipeline").glob("*.py"))
    assert len(top) <= 15, top
    for room in ROOMS:
        package = importlib.import_module(f"pipeline.{room}")
        assert (package.__doc__ or "").strip(), room
        for public in getattr(package, "__all__", []):
            assert getattr(package, public) is not None, (room, public)


def test_span_names_live_only_in_tracing() -> None:
    literal = re.compile(r"""start_as_current_span\(\s*["']|start_span\(\s*["']""")
    for name, path in LIBRARY.items():
        if name == "pipeline.tracing":
            continue
        assert not literal.search(path.read_text(encoding="utf-8")), name
