"""pdkv's import graph, read from the source (every import a module runs, lazy ones in
functions included, ``if TYPE_CHECKING:`` blocks left out): no cycles, no upward imports,
the sessions reach transports only through the registry, the library never imports a CLI."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent / "pdkv"

# the parts of the library, lower first: a module may import only modules of its own part or
# of a part below it (a package's __init__ belongs to its part; pdkv's own __init__ is last)
PARTS = [
    "pdkv.errors",
    "pdkv.httpserver",
    "pdkv._ffi",
    "pdkv.procs",
    "pdkv.layout",
    "pdkv.protocol",
    "pdkv.plan",
    "pdkv.scheduling",
    "pdkv.buffer",
    "pdkv.swap",
    "pdkv.integrations.interop",
    "pdkv.transfer.transports",
    "pdkv.transfer.sessions",
    "pdkv.transfer",
    "pdkv.integrations",
    "pdkv.native",
    "pdkv.metrics",
    "pdkv",
]
TOP_LEVEL_MAX = 8  # pdkv's own modules besides its packages: only what every part shares
LINES_MAX = 600
TRANSPORTS = {
    "pdkv.transfer.transports.shm",
    "pdkv.transfer.transports.tcp",
    "pdkv.transfer.transports.rdma",
    "pdkv.transfer.transports.cuda_ipc",
    "pdkv.transfer.transports.nixl",
}


def _part(mod: str) -> int:
    """The index in PARTS of the longest part that holds ``mod``."""
    best = max((p for p in PARTS if mod == p or mod.startswith(p + ".")), key=len)
    return PARTS.index(best)


def _module(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imports(path: Path, mod: str, modules: set[str]) -> set[str]:
    package = mod if path.name == "__init__.py" else mod.rsplit(".", 1)[0]
    out: set[str] = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name.split(".")[0] == "pdkv")
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.split(".")[0] == "pdkv":
                for a in node.names:  # `from . import x` names a submodule where one exists
                    sub = f"{target}.{a.name}"
                    out.add(sub if sub in modules else target)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(path.read_text()))
    out.discard(mod)
    return {m if m in modules else m.rsplit(".", 1)[0] for m in out}


def _graph() -> dict[str, set[str]]:
    files = {_module(p): p for p in ROOT.rglob("*.py")}
    modules = set(files)
    return {m: _imports(p, m, modules) for m, p in files.items()}


def test_every_library_module_imports_no_part_above_its_own():
    graph = _graph()
    library = {m for m in graph if not m.startswith("pdkv.cli")}
    upward = sorted((m, d) for m in library for d in graph[m] if _part(d) > _part(m))
    assert upward == [], f"upward imports: {upward}"


def test_the_import_graph_has_no_cycles():
    """Every import counts, lazy ones in functions and those under ``if TYPE_CHECKING:``
    too (a type-only import is the same dependency, checked later)."""
    edges = _graph()
    state: dict[str, int] = {}
    stack: list[str] = []

    def dfs(m: str) -> None:
        state[m] = 1
        stack.append(m)
        for d in sorted(edges.get(m, ())):
            if state.get(d) == 1:
                raise AssertionError(f"import cycle: {' -> '.join(stack[stack.index(d) :] + [d])}")
            if d not in state:
                dfs(d)
        stack.pop()
        state[m] = 2

    for m in sorted(edges):
        if m not in state:
            dfs(m)


def test_the_tree_shows_the_parts():
    """Few top-level modules, no two modules of one file name, none over LINES_MAX lines,
    and every package's __init__ says its job and what it may import."""
    files = sorted(p for p in ROOT.rglob("*.py") if "__pycache__" not in p.parts)
    top = [p for p in files if p.parent == ROOT and p.name != "__init__.py"]
    assert len(top) <= TOP_LEVEL_MAX, [p.name for p in top]
    names: dict[str, list[str]] = {}
    for p in files:
        if p.name not in ("__init__.py", "__main__.py"):
            names.setdefault(p.name, []).append(str(p.relative_to(ROOT)))
    assert {n: ps for n, ps in names.items() if len(ps) > 1} == {}
    long = {str(p.relative_to(ROOT)): n for p in files if (n := len(p.read_text().splitlines())) > LINES_MAX}
    assert long == {}
    for p in files:
        if p.name == "__init__.py" and p.parent != ROOT:
            doc = ast.get_docstring(ast.parse(p.read_text())) or ""
            assert "May import" in doc, f"{p}: its docstring says what the package may import"


def test_a_planted_cycle_and_a_planted_upward_import_are_caught(tmp_path, monkeypatch):
    """The checks above can fail: a copy of the tree with a back edge is refused by both."""
    import shutil

    copy = tmp_path / "pdkv"
    shutil.copytree(ROOT, copy, ignore=shutil.ignore_patterns("__pycache__"))
    layout = copy / "layout.py"
    layout.write_text(layout.read_text() + "\nfrom .scheduling import scheduler as _planted  # noqa\n")
    monkeypatch.setattr(__import__(__name__), "ROOT", copy)
    import pytest

    with pytest.raises(AssertionError, match="upward imports"):
        test_every_library_module_imports_no_part_above_its_own()
    with pytest.raises(AssertionError, match="import cycle"):
        test_the_import_graph_has_no_cycles()


def test_sessions_reach_transports_only_through_the_registry_and_nothing_imports_a_cli():
    graph = _graph()
    sessions = [m for m in graph if m.startswith("pdkv.transfer.sessions.")]
    assert len(sessions) >= 9, sessions
    for session in sessions:
        assert graph[session] & TRANSPORTS == set(), f"{session} imports a transport module"
    assert [
        m for m, ds in graph.items() if not m.startswith("pdkv.cli") and any(d.startswith("pdkv.cli") for d in ds)
    ] == []
    assert (
        graph["pdkv.scheduling.scheduler"]
        & {"pdkv.protocol", "pdkv.buffer.shared", "pdkv.swap", "pdkv._ffi", "pdkv.transfer"}
        == set()
    )
