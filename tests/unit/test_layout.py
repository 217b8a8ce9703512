"""The package layout: the data path reads from the folders, so imports only go one way.
Every import in vllm_hidden (lazy ones inside functions included) is read from the source:
no import cycle between the packages, none between the modules, and vLLM imported only
under engine/."""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

import vllm_hidden

ROOT = Path(vllm_hidden.__file__).parent


def _modules() -> dict[str, Path]:
    out = {}
    for p in ROOT.rglob("*.py"):
        parts = p.relative_to(ROOT.parent).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = p
    return out


def _imports(name: str, path: Path) -> set[str]:
    """Every module `name` imports (absolute names; `from a import b` counts a and a.b)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            found.add(mod)
            found.update(f"{mod}.{a.name}" for a in node.names)
    return found


def _graph(depth: int) -> dict[str, set[str]]:
    """Edges between the names of `depth` parts (2: vllm_hidden.<package or module>)."""
    mods = _modules()
    g: dict[str, set[str]] = defaultdict(set)
    for name, path in mods.items():
        src = ".".join(name.split(".")[:depth])
        for dep in _imports(name, path) & set(mods):
            dst = ".".join(dep.split(".")[:depth])
            if dst != src and dep != name:
                g[src].add(dst)
    return g


def _cycles(g: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one node (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(g.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(g):
        if v not in index:
            visit(v)
    return found


def test_the_checker_finds_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycle_between_packages():
    g = _graph(2)
    assert "vllm_hidden.engine" in g and "vllm_hidden.extract" in g  # the graph is really read
    assert _cycles(g) == []


def test_no_import_cycle_between_modules():
    assert _cycles(_graph(99)) == []


def test_the_data_path_goes_one_way():
    g = _graph(2)
    # the engine and what it runs never reach up to the jobs, the server or the CLI above them
    for low in ("vllm_hidden.engine", "vllm_hidden.capture", "vllm_hidden.storage", "vllm_hidden.data"):
        up = g.get(low, set()) & {"vllm_hidden.extract", "vllm_hidden.server", "vllm_hidden.cli", "vllm_hidden.warmup"}
        assert not up, (low, up)


def test_vllm_is_imported_only_under_engine():
    outside = []
    for name, path in _modules().items():
        if name.startswith("vllm_hidden.engine"):
            continue
        if any(m == "vllm" or m.startswith("vllm.") for m in _imports(name, path)):
            outside.append(name)
    assert outside == []


def test_no_package_exports_a_name_of_its_own_submodule():
    """Importing a submodule sets it as an attribute of its package: a submodule named like a
    name the package exports (`vllm_hidden.server.fetch`, the client helper) would replace that
    name as soon as anything imports the submodule."""
    clashes = []
    for init in ROOT.rglob("__init__.py"):
        pkg = init.parent
        subs = {p.stem for p in pkg.glob("*.py")} | {p.name for p in pkg.iterdir() if (p / "__init__.py").is_file()}
        for node in ast.walk(ast.parse(init.read_text())):
            if isinstance(node, ast.ImportFrom):
                clashes += [(str(pkg), a.asname or a.name) for a in node.names if (a.asname or a.name) in subs]
    assert clashes == []


def test_the_client_helpers_survive_the_server_modules_being_imported():
    import vllm_hidden.server.middleware  # noqa: F401 - imports every server module
    from vllm_hidden.server import decode, fetch

    assert callable(decode) and callable(fetch) and fetch.__module__ == "vllm_hidden.server.protocol"
