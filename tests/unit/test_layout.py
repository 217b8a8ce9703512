"""The package layout: the data path reads from the folders, so imports only go one way.
Every import in vllm_hidden (lazy ones inside functions included) is read from the source:
each package imports only what its row of `ALLOWED` names, no import cycle between the
packages, none between the modules, and vLLM imported only under engine/."""

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


# Which packages (and top-level modules) of vllm_hidden each may import: the data path, read
# from the bottom up. A package not in the table, or an import not in its row, fails
# `test_imports_follow_the_table`; an upward import is one not in the row.
ALLOWED: dict[str, set[str]] = {
    # the bottom: definitions and pure functions (the package's own __init__: its version)
    "vllm_hidden": set(), "envs": set(), "errors": set(), "layers": set(), "devices": set(), "format": set(),
    "demo": set(),
    "config": {"envs", "layers"},
    "cli_options": {"config"},
    "inputs": {"config", "layers"},
    # what the runner hook hands the host side, and the sink contract (capture.records)
    "capture": {"envs", "config", "format"},
    # shard writer (a capture sink), manifest, uploads, verification
    "storage": {"capture", "config", "format", "layers"},
    # the reader, over what storage wrote
    "data": {"format", "layers", "storage"},
    # the vLLM adapter: the capture hook in the runner and the sinks it opens
    "engine": {"errors", "envs", "capture", "config", "devices", "format", "layers", "storage"},
    # the jobs over the engine and the output
    "extract": {"errors", "envs", "vllm_hidden", "capture", "config", "devices", "engine", "format", "inputs", "layers",
                "storage"},
    "warmup": {"config", "engine", "extract", "layers"},
    # colocated training: an extract's engine in the trainer's process, its rows to device tensors
    "colocate": {"capture", "config", "engine", "extract", "inputs"},
    # warm caches as one archive: the cache root's layout (engine.caches) and S3 reads (storage.s3)
    "cache_archive": {"errors", "engine", "storage"},
    "server": {"envs", "capture", "config", "engine", "format", "layers"},
    "check": {"config", "data", "engine", "format", "layers", "storage"},
    "export": {"config", "data", "format", "layers", "storage"},
    # the top: parses and reports, may use any of them
    "cli": {"errors", "cli_options", "vllm_hidden", "config", "layers", "devices", "format", "demo", "inputs",
            "capture", "storage", "data", "engine", "extract", "warmup", "cache_archive", "server", "check", "export"},
}


def _short(name: str) -> str:
    return name.split(".", 1)[1] if "." in name else name


def _violations(g: dict[str, set[str]], allowed: dict[str, set[str]]) -> list[str]:
    """Edges of the package graph `g` (short names) that the table does not allow, and
    packages it does not place."""
    bad = [f"{src} is not in the table" for src in sorted(g) if src not in allowed]
    bad += [f"{src} imports {dst}" for src in sorted(g) if src in allowed for dst in sorted(g[src] - allowed[src])]
    return bad


def test_the_table_checker_finds_an_upward_import():
    assert _violations({"engine": {"capture", "extract"}}, ALLOWED) == ["engine imports extract"]
    assert _violations({"new": {"config"}}, ALLOWED) == ["new is not in the table"]
    assert _violations({"storage": {"format"}}, ALLOWED) == []


def test_imports_follow_the_table():
    g = {_short(src): {_short(d) for d in dsts} for src, dsts in _graph(2).items()}
    assert "engine" in g and "extract" in g["warmup"]  # the graph is really read
    pkgs = {_short(".".join(n.split(".")[:2])) for n in _modules()}
    assert pkgs <= set(ALLOWED), sorted(pkgs - set(ALLOWED))  # every package and module has its row
    assert _violations(g, ALLOWED) == []


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
