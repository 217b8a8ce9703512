"""engine/compat.py is the one place that tells vLLM versions apart and reads vLLM's private
state (engine/hooks.py's HOOKS: every vLLM attribute we replace or set). Checked on the source
of every module under vllm_hidden/ (ast), so a probe on a path no test runs is caught too:

- a version probe (`VLLM_VERSION`, `version_tuple`, `vllm.__version__`) or a `try: import
  vllm... except ImportError` outside engine/compat.py;
- an attribute starting with an underscore read (or get/has/set/delattr'd by name) on an object
  other than self/cls or our own modules and their names, in engine/ modules other than
  compat.py and hooks.py (hooks names the private vLLM methods it replaces).
"""

from __future__ import annotations

import ast
from pathlib import Path
from typing import NamedTuple

import vllm_hidden

PACKAGE = Path(vllm_hidden.__file__).parent
SEAM = "engine/compat.py"
PRIVATE_READERS = frozenset({SEAM, "engine/hooks.py"})
VERSION_NAMES = frozenset({"VLLM_VERSION", "version_tuple"})
IMPORT_ERRORS = frozenset({"ImportError", "ModuleNotFoundError", "Exception", "BaseException"})
ATTR_BUILTINS = frozenset({"getattr", "hasattr", "setattr", "delattr"})

# Reads of the version string that only name it (nothing branches on it): (module, scope) -> why.
REPORTS_VERSION = {
    ("engine/hooks.py", "HookError.__init__"): "names the installed vLLM in the error for a missing hook target",
    ("extract/job.py", "manifest_fields"): "records the vLLM version in the output's manifest",
}
# Private attributes of our own objects that engine/ modules may read on something other than
# self/cls (e.g. another of our objects held in a local): name -> why. None is needed today.
OWN_PRIVATE: dict[str, str] = {}


class Finding(NamedTuple):
    module: str
    line: int
    kind: str  # "version probe", "import probe", "private attribute"
    scope: str
    code: str

    def __str__(self) -> str:
        return f"vllm_hidden/{self.module}:{self.line} ({self.scope}): {self.kind}: {self.code}"


def _top(module: str | None) -> str:
    return (module or "").split(".")[0]


def _is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _imports_vllm(stmts: list[ast.stmt]) -> bool:
    for node in (n for s in stmts for n in ast.walk(s)):
        if isinstance(node, ast.Import) and any(a.name.split(".")[0] == "vllm" for a in node.names):
            return True
        if isinstance(node, ast.ImportFrom) and not node.level and _top(node.module) == "vllm":
            return True
        if (isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", None)) == "import_module"
                and node.args and isinstance(node.args[0], ast.Constant)
                and _top(str(node.args[0].value)) == "vllm"):
            return True
    return False


def _catches_import_error(handler: ast.ExceptHandler) -> bool:
    if handler.type is None:
        return True
    types = handler.type.elts if isinstance(handler.type, ast.Tuple) else [handler.type]
    return any(getattr(t, "id", getattr(t, "attr", None)) in IMPORT_ERRORS for t in types)


class _Seam(ast.NodeVisitor):
    def __init__(self, module: str, reports: dict, own_private: dict) -> None:
        self.module = module
        self.reports, self.own_private = reports, own_private
        self.versions_checked = module != SEAM
        self.private_checked = module.startswith("engine/") and module not in PRIVATE_READERS
        self.ours = {"self", "cls"}  # names whose private attributes are our own
        self.vllm = set()  # names bound to the vllm package itself
        self.scope: list[str] = []
        self.found: list[Finding] = []
        self.allowed: set[tuple[str, str]] = set()

    def run(self, tree: ast.Module) -> None:
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for a in node.names:
                    top = a.name.split(".")[0]
                    if top == "vllm_hidden":
                        self.ours.add(a.asname or top)
                    elif top == "vllm" and (a.asname is None or a.name == "vllm"):
                        self.vllm.add(a.asname or top)
            elif isinstance(node, ast.ImportFrom) and (node.level or _top(node.module) == "vllm_hidden"):
                self.ours.update(a.asname or a.name for a in node.names)
        self.visit(tree)

    # -- findings -------------------------------------------------------------------------
    def _where(self) -> str:
        return ".".join(self.scope) or "<module>"

    def _add(self, node: ast.AST, kind: str) -> None:
        self.found.append(Finding(self.module, node.lineno, kind, self._where(), ast.unparse(node)))

    def _version(self, node: ast.AST) -> None:
        if not self.versions_checked:
            return
        key = (self.module, self._where())
        if key in self.reports:
            self.allowed.add(key)
        else:
            self._add(node, "version probe")

    def _private(self, node: ast.AST, owner: ast.AST, name: str) -> None:
        if (self.private_checked and _is_private(name) and name not in self.own_private
                and not (isinstance(owner, ast.Name) and owner.id in self.ours)):
            self._add(node, "private attribute")

    # -- scopes ---------------------------------------------------------------------------
    def _scoped(self, node) -> None:
        self.scope.append(node.name)
        self.generic_visit(node)
        self.scope.pop()

    visit_FunctionDef = visit_AsyncFunctionDef = visit_ClassDef = _scoped

    # -- nodes ----------------------------------------------------------------------------
    def visit_Name(self, node: ast.Name) -> None:
        if node.id in VERSION_NAMES:
            self._version(node)

    def visit_Attribute(self, node: ast.Attribute) -> None:
        if node.attr in VERSION_NAMES or (node.attr == "__version__" and isinstance(node.value, ast.Name)
                                          and node.value.id in self.vllm):
            self._version(node)
        self._private(node, node.value, node.attr)
        self.generic_visit(node)

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        names = {a.name for a in node.names}
        if names & VERSION_NAMES or (_top(node.module) == "vllm" and "__version__" in names):
            self._version(node)

    def visit_Call(self, node: ast.Call) -> None:
        if (isinstance(node.func, ast.Name) and node.func.id in ATTR_BUILTINS and len(node.args) >= 2
                and isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str)):
            name, owner = node.args[1].value, node.args[0]
            if name == "__version__" and isinstance(owner, ast.Name) and owner.id in self.vllm:
                self._version(node)
            self._private(node, owner, name)
        self.generic_visit(node)

    def visit_Try(self, node: ast.Try) -> None:
        if self.versions_checked and _imports_vllm(node.body) and any(map(_catches_import_error, node.handlers)):
            self.found.append(Finding(self.module, node.lineno, "import probe", self._where(),
                                      ast.unparse(node).splitlines()[1].strip()))
        self.generic_visit(node)

    visit_TryStar = visit_Try


def check(source: str, module: str, reports: dict | None = None,
          own_private: dict | None = None) -> tuple[list[Finding], set[tuple[str, str]]]:
    """The seam's findings in one module's source (`module`: its path under vllm_hidden/), and
    the `reports` entries it used."""
    seam = _Seam(module, REPORTS_VERSION if reports is None else reports,
                 OWN_PRIVATE if own_private is None else own_private)
    seam.run(ast.parse(source))
    return seam.found, seam.allowed


def test_every_version_probe_and_private_vllm_read_is_in_compat():
    found, allowed = [], set()
    modules = sorted(PACKAGE.rglob("*.py"))
    assert len(modules) > 40 and (PACKAGE / SEAM) in modules
    for path in modules:
        f, a = check(path.read_text(), path.relative_to(PACKAGE).as_posix())
        found += f
        allowed |= a
    assert not found, "move these into vllm_hidden/engine/compat.py:\n" + "\n".join(map(str, found))
    stale = set(REPORTS_VERSION) - allowed
    assert not stale, f"REPORTS_VERSION entries that match no code any more (remove them): {sorted(stale)}"


# -- the checker itself -------------------------------------------------------------------------

VIOLATIONS = '''\
import vllm
from vllm.v1.core.sched.output import SchedulerOutput
from vllm_hidden.engine import compat, hooks


def probe(runner, out: SchedulerOutput):
    if compat.version_tuple() >= (0, 32):
        pass
    name = vllm.__version__
    try:
        from vllm.logger import configure_logging_from_args
    except ImportError:
        configure_logging_from_args = None
    runner._setup_eagle3_aux_hidden_state_outputs()
    count = getattr(runner.vllm_config.parallel_config, "_api_process_count", 1)
    return name, count, super()._update_states(out), out.__class__, hooks._install_capture
'''
# line -> kind, for VIOLATIONS
WANT = {7: "version probe", 9: "version probe", 10: "import probe", 14: "private attribute",
        15: "private attribute", 16: "private attribute"}


def _kinds(found: list[Finding]) -> dict[int, str]:
    return {f.line: f.kind for f in found}


def test_checker_flags_deliberate_violations_where_each_rule_applies():
    found, _ = check(VIOLATIONS, "engine/runner.py", reports={})
    assert _kinds(found) == WANT, "\n".join(map(str, found))
    assert all(f.scope == "probe" for f in found)
    # private reads are an engine/ rule; version and import probes hold everywhere but compat
    assert _kinds(check(VIOLATIONS, "server/middleware.py", reports={})[0]) == {
        k: v for k, v in WANT.items() if v != "private attribute"}
    assert _kinds(check(VIOLATIONS, "engine/hooks.py", reports={})[0]) == {
        k: v for k, v in WANT.items() if v != "private attribute"}
    assert check(VIOLATIONS, SEAM, reports={})[0] == []


def test_checker_passes_our_own_names_and_allow_listed_reports():
    clean = '''\
import boto3
from vllm_hidden import __version__
from vllm_hidden.engine import compat, hooks
from . import caches


class Capture:
    def __init__(self, runner, other):
        self._tracked = {}
        self.other = other
        hooks._install_capture(runner, None)
        caches._APPLIED.clear()
        try:
            import boto3
        except ImportError:
            pass

    @classmethod
    def make(cls):
        return cls._cache, __version__, type(cls).__name__

    def peek(self):
        return self.other._tracked


def reported():
    return f"vLLM {compat.VLLM_VERSION}"
'''
    found, _ = check(clean, "engine/runner.py", reports={})
    assert [(f.line, f.kind) for f in found] == [(23, "private attribute"), (27, "version probe")], found
    found, used = check(clean, "engine/runner.py", reports={("engine/runner.py", "reported"): "names it"},
                        own_private={"_tracked": "our Capture's"})
    assert found == [] and used == {("engine/runner.py", "reported")}
    # an allow-listed scope allows that scope only
    moved = clean.replace("def reported", "def branches")
    assert _kinds(check(moved, "engine/runner.py", reports={("engine/runner.py", "reported"): "names it"},
                        own_private={"_tracked": "ours"})[0]) == {27: "version probe"}


def test_checker_sees_every_spelling_of_a_vllm_import_probe():
    for body, handler in [("import vllm.envs", "except ModuleNotFoundError"), ("import vllm as v", "except Exception"),
                          ("from vllm import envs", "except (OSError, ImportError)"),
                          ("importlib.import_module('vllm.logger')", "except:")]:
        src = f"def f():\n    try:\n        {body}\n    {handler}:\n        pass\n".replace("::", ":")
        assert _kinds(check(src, "check/__init__.py", reports={})[0]) == {2: "import probe"}, src
    assert check("try:\n    import vllm\nexcept OSError:\n    pass\n", "cli.py", reports={})[0] == []
