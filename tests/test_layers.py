"""pdkv's import graph, read from the source (every import a module runs, lazy ones in
functions included, ``if TYPE_CHECKING:`` blocks left out): no cycles, no upward imports,
the sessions reach transports only through the registry, the library never imports a CLI."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent / "pdkv"

# lower layers first; a module may import only modules of its own layer or below
LAYERS = [
    {"pdkv.errors"},
    {"pdkv._ffi", "pdkv._ffi.libc", "pdkv._ffi.cpu", "pdkv._ffi.cuda", "pdkv._ffi.verbs", "pdkv._ffi.nixl"},
    {"pdkv.procs", "pdkv.kernels", "pdkv.layout"},
    {"pdkv.plan"},
    {"pdkv.blocks", "pdkv.lifecycle"},
    {"pdkv.schedloop", "pdkv.schedview", "pdkv.scheduler"},
    {"pdkv.protocol", "pdkv.shmseg", "pdkv.rdma", "pdkv.interop"},
    {"pdkv.shm", "pdkv.shmclean", "pdkv.swap", "pdkv.cuda_ipc", "pdkv.native", "pdkv.modelcache"},
    {"pdkv.workers"},
    {
        "pdkv.transfer.base",
        "pdkv.transfer.options",
        "pdkv.transfer.channel",
        "pdkv.transfer.guard",
        "pdkv.transfer.hostcopy",
        "pdkv.transfer.sockets",
        "pdkv.transfer.staging",
    },
    {"pdkv.transfer.shm", "pdkv.transfer.tcp", "pdkv.transfer.rdma", "pdkv.transfer.cuda_ipc", "pdkv.transfer.nixl"},
    {"pdkv.transfer.handshake", "pdkv.transfer.decode", "pdkv.transfer.prefill"},
    {"pdkv.transfer", "pdkv", "pdkv.metrics"},  # metrics observes a scheduler and a receiver
]
TRANSPORTS = {
    "pdkv.transfer.shm",
    "pdkv.transfer.tcp",
    "pdkv.transfer.rdma",
    "pdkv.transfer.cuda_ipc",
    "pdkv.transfer.nixl",
}


def _module(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _is_type_checking(node: ast.If) -> bool:
    t = node.test
    return (isinstance(t, ast.Name) and t.id == "TYPE_CHECKING") or (
        isinstance(t, ast.Attribute) and t.attr == "TYPE_CHECKING"
    )


def _imports(path: Path, mod: str, modules: set[str]) -> set[str]:
    package = mod if path.name == "__init__.py" else mod.rsplit(".", 1)[0]
    out: set[str] = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node):
            for n in node.orelse:
                visit(n)
            return
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


def test_every_library_module_has_a_layer_and_imports_no_layer_above_its_own():
    graph = _graph()
    layer = {m: i for i, group in enumerate(LAYERS) for m in group}
    library = {m for m in graph if not m.startswith("pdkv.cli")}
    assert library - set(layer) == set(), "give every new module a layer in LAYERS"
    upward = [(m, d) for m in library for d in graph[m] if layer.get(d, len(LAYERS)) > layer[m]]
    assert upward == [], f"upward imports: {sorted(upward)}"


def test_the_import_graph_has_no_cycles():
    graph = _graph()
    # the package __init__ files import their submodules by design; a cycle through one is
    # a submodule importing its package, caught by the layer test
    edges = {m: {d for d in ds if d not in ("pdkv", "pdkv.transfer")} for m, ds in graph.items()}
    state: dict[str, int] = {}
    stack: list[str] = []

    def dfs(m: str) -> None:
        state[m] = 1
        stack.append(m)
        for d in edges.get(m, ()):
            if state.get(d) == 1:
                raise AssertionError(f"import cycle: {' -> '.join(stack[stack.index(d) :] + [d])}")
            if d not in state:
                dfs(d)
        stack.pop()
        state[m] = 2

    for m in sorted(edges):
        if m not in state:
            dfs(m)


def test_sessions_reach_transports_only_through_the_registry_and_nothing_imports_a_cli():
    graph = _graph()
    for session in ("pdkv.transfer.decode", "pdkv.transfer.prefill", "pdkv.transfer.handshake"):
        assert graph[session] & TRANSPORTS == set(), f"{session} imports a transport module"
    assert [
        m for m, ds in graph.items() if not m.startswith("pdkv.cli") and any(d.startswith("pdkv.cli") for d in ds)
    ] == []
    assert graph["pdkv.scheduler"] & {"pdkv.protocol", "pdkv.shm", "pdkv.swap", "pdkv._ffi", "pdkv.transfer"} == set()
