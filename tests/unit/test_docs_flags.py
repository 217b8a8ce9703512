"""Every `--flag` written in README.md and docs/*.md exists.

Each flag is checked against the command it belongs to:
- a shell line or an inline code span that starts with a command gives its flags to that
  command: `vllm-hidden SUB` (its typer options, read from the click command objects, plus
  vLLM's own engine or server options where SUB passes unknown options on to vLLM),
  `vllm serve`, `python scripts/X.py` (that script's argparse options), `pytest` /
  `scripts/test.sh` (pytest's and its plugins' options), the trainers' `speculators train`
  and `specforge train` (their own parsers: both are installed for the tests), or a few
  other tools (OTHER_TOOLS);
- any other flag (prose, tables, comments) must be an option of some `vllm-hidden`
  subcommand or of vLLM's engine or server, or of a command named earlier in the same
  paragraph, or be listed in PROSE_ONLY; a flag in a block that is not shell (a command's
  printed output) may also be one of a command the paragraph before the block names.
Parsers are read from the objects themselves (typer/click, argparse, pytest's parser), never
from help text. vLLM's parsers, the scripts and a fresh pytest parser are read in
subprocesses, so nothing they import stays in this process.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# Flags of tools that are neither ours, nor vLLM's, nor pytest's, by the command a line
# starts with. Kept to what the docs quote; add a flag here when a page quotes a new one.
OTHER_TOOLS: dict[str, set[str]] = {
    "pip": {"--no-deps"},  # pip install
    "ray": {"--head", "--port", "--address"},  # ray start
    "curl": set(),  # the docs use only -s, -H, -d
    "b3sum": set(),
}
# Flags named in prose without their command: another project's tool.
PROSE_ONLY: dict[str, str] = {
    "--dry-run": "speculators' scripts/launch_vllm.py (not installed: a script in its repository)",
    "--no-include-last-layer": "speculators' scripts/launch_vllm.py",
    "--hidden-states-backend": "speculators' scripts/launch_vllm.py (and `speculators train`)",
}

FLAG = re.compile(r"(?<![\w/.#-])--[A-Za-z][\w-]*")  # not inside a path, a word or a link anchor
FENCE = re.compile(r"^\s*(```|~~~)\s*([\w+-]*)")
SHELL_LANGS = {"bash", "sh", "shell", "console", "zsh"}
ENV_ASSIGN = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=\S*$")
CODE_SPAN = re.compile(r"`([^`]+)`")

MARK = "DOCS-FLAGS-JSON:"


def doc_files() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


# --- what the parsers accept ---------------------------------------------------------------

@lru_cache(maxsize=None)
def ours() -> dict[str, set[str]]:
    """`vllm-hidden` subcommand -> its option strings ("" -> the top level's), from the
    command objects typer builds (click's, or the copy of click that typer ships)."""
    import typer.main

    from vllm_hidden.cli import app

    def options(cmd, ctx) -> set[str]:  # options, not arguments: their names start with "-"
        return {o for p in cmd.get_params(ctx) for o in (*p.opts, *p.secondary_opts) if o.startswith("-")}

    group = typer.main.get_command(app)
    top = group.context_class(group, info_name="vllm-hidden")
    out = {"": options(group, top)}
    for name, cmd in group.commands.items():
        out[name] = options(cmd, cmd.context_class(cmd, info_name=name, parent=top))
    return out


def _run_json(code: str, *args: str) -> dict:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in [str(ROOT), os.environ.get("PYTHONPATH")] if p)}
    r = subprocess.run([sys.executable, "-c", code, *args], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=600)
    for line in r.stdout.splitlines():
        if line.startswith(MARK):
            return json.loads(line[len(MARK):])
    raise AssertionError(f"reading flags failed (exit {r.returncode}):\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}")


# One interpreter reads vLLM's parsers and then the trainers' (both import torch: once).
_PARSERS = f"""
import argparse, json
from vllm.engine.arg_utils import EngineArgs
from vllm.entrypoints.cli import serve as vserve
from vllm.utils.argparse_utils import FlexibleArgumentParser

def opts(p):
    return sorted(s for a in p._actions for s in a.option_strings)

engine = EngineArgs.add_cli_args(FlexibleArgumentParser())
# as vllm_hidden.server.launch.run_vllm_serve builds it: vLLM's `serve` subcommand parser
sub = FlexibleArgumentParser().add_subparsers(required=True, dest="subparser")
serve = vserve.cmd_init()[0].subparser_init(sub)
out = {{"engine": opts(engine), "serve": opts(serve)}}

class Parsed(Exception):
    pass

def grab(self, args=None, namespace=None):
    raise Parsed(self)

from speculators.train.config.resolution import build_parser  # what `speculators train` parses with
out["speculators train"] = opts(build_parser())
argparse.ArgumentParser.parse_args = argparse.ArgumentParser.parse_known_args = grab
from specforge import cli  # `specforge train`: a subparser its main() builds
try:
    cli.main(["train"])
except Parsed as e:
    out["specforge train"] = opts(next(a for a in e.args[0]._actions
                                       if isinstance(a, argparse._SubParsersAction)).choices["train"])
print({MARK!r} + json.dumps(out))
"""


@lru_cache(maxsize=None)
def _parsers() -> dict[str, set[str]]:
    return {k: set(v) for k, v in _run_json(_PARSERS).items()}


def vllm_flags() -> dict[str, set[str]]:
    """vLLM's engine arguments (what `extract`/`warmup` pass on) and its `serve` options, each
    also with underscores (vLLM's parser reads `--a_b` as `--a-b`)."""
    return {k: (v := _parsers()[k]) | {"--" + f[2:].replace("-", "_") for f in v if f.startswith("--")}
            for k in ("engine", "serve")}


def trainer_flags() -> dict[str, set[str]]:
    """`speculators train` and `specforge train` -> their options, from the installed trainers."""
    return {k: _parsers()[k] for k in ("speculators train", "specforge train")}


# Each script is run up to its first argument parse, which raises with the parser's options
# instead of parsing; only scripts that parse arguments with argparse are run at all.
_SCRIPTS = f"""
import argparse, json, os, runpy, sys

class Parsed(Exception):
    pass

def grab(self, args=None, namespace=None):
    raise Parsed(sorted(s for a in self._actions for s in a.option_strings))

argparse.ArgumentParser.parse_known_args = grab
out = {{}}
for path in sys.argv[1:]:
    sys.argv = [path]
    sys.path.insert(0, os.path.dirname(os.path.abspath(path)))
    try:
        runpy.run_path(path, run_name="__main__")
        out[path] = None
    except Parsed as e:
        out[path] = e.args[0]
print({MARK!r} + json.dumps(out))
"""


def script_flags(paths: list[str]) -> dict[str, set[str] | None]:
    """scripts/X.py -> its argparse options (None: it parses no arguments)."""
    runnable = [p for p in paths if re.search(r"parse_(known_)?args|ArgumentParser", (ROOT / p).read_text())]
    got = _run_json(_SCRIPTS, *runnable) if runnable else {}
    return {p: set(got[p]) if got.get(p) is not None else None for p in paths}


_PYTEST = f"""
import json
from _pytest.config import get_config

config = get_config()  # pytest's own plugins, whatever -p options a session was given
config.pluginmanager.load_setuptools_entrypoints("pytest11")  # and every installed plugin
parser = config._parser
print({MARK!r} + json.dumps(sorted(n for group in [parser._anonymous, *parser._groups]
                                   for o in group.options for n in o.names())))
"""


def pytest_flags(config) -> set[str]:
    """pytest's options: those of pytest and every installed plugin, read in a fresh process,
    and those this session's parser holds (conftest files' options included)."""
    parser = config._parser
    session = {n for group in [parser._anonymous, *parser._groups] for o in group.options for n in o.names()}
    return session | set(_fresh_pytest_flags())


@lru_cache(maxsize=None)
def _fresh_pytest_flags() -> tuple[str, ...]:
    return tuple(_run_json(_PYTEST))


# --- where each flag belongs -----------------------------------------------------------------

@dataclass(frozen=True)
class Flag:
    file: str
    line: int
    flag: str
    command: tuple[str, str] | None  # (kind, name), None: prose
    context: tuple[tuple[str, str], ...] = ()  # commands named earlier in the same paragraph


def command_of(text: str) -> tuple[str, str] | None:
    """The command a shell line (or a code span) starts with: ("vllm-hidden", sub),
    ("vllm", "serve"), ("script", path), ("pytest", ""), (tool, "") or None."""
    words = text.strip().lstrip("$ ").split()
    while words and ENV_ASSIGN.match(words[0]):
        words = words[1:]
    if not words:
        return None
    w, via_python = words[0], False
    if w in ("python", "python3") and len(words) > 1:
        if words[1] == "-m" and len(words) > 2:
            mod, rest = words[2], words[3:]
            if mod == "vllm_hidden.cli":
                return ("vllm-hidden", rest[0] if rest and not rest[0].startswith("-") else "")
            if mod in ("pytest", "pip"):
                return (mod, "")
            return ("unknown", f"python -m {mod}")
        w, words, via_python = words[1], words[1:], True
    if w == "vllm-hidden":
        return ("vllm-hidden", words[1] if len(words) > 1 and not words[1].startswith("-") else "")
    if w == "vllm" and len(words) > 1 and words[1] == "serve":
        return ("vllm", "serve")
    if w == "scripts/test.sh":
        return ("pytest", "")  # it passes its arguments to pytest
    if w == "scripts/demo.sh":
        return ("vllm-hidden", "extract")  # it passes its arguments to `vllm-hidden extract`
    if w.startswith("scripts/") and w.endswith(".sh"):
        return ("unknown", w)  # takes no options
    if w.endswith(".py") and (via_python or w.startswith("scripts/")):
        return ("script", w)
    if w in ("speculators", "specforge") and len(words) > 1 and words[1] == "train":
        return ("trainer", f"{w} train")
    if w in ("pytest", *OTHER_TOOLS):
        return (w, "")
    return None


def _logical_lines(lines: list[tuple[int, str]]) -> list[tuple[int, str]]:
    """Shell lines with their `\\` continuations joined, each with the line it starts on."""
    out: list[tuple[int, str]] = []
    buf, start = "", None
    for n, text in lines:
        if start is None:
            start = n
        if text.rstrip().endswith("\\"):
            buf += text.rstrip()[:-1] + "\n"
            continue
        out.append((start, buf + text))
        buf, start = "", None
    if start is not None:
        out.append((start, buf))
    return out


def _flags_at(file: str, first_line: int, text: str, command, context=()) -> list[Flag]:
    return [Flag(file, first_line + text.count("\n", 0, m.start()), m.group(), command, tuple(context))
            for m in FLAG.finditer(text)]


def _prose(file: str, first_line: int, text: str) -> list[Flag]:
    """One paragraph: code spans that start with a command give it their flags; every other
    flag is prose, with the commands named before it in the paragraph as context."""
    found: list[Flag] = []
    named: list[tuple[str, str]] = []
    taken: list[tuple[int, int]] = []
    for m in CODE_SPAN.finditer(text):
        cmd = command_of(m.group(1))
        if cmd is None:
            continue
        found += [Flag(file, first_line + text.count("\n", 0, m.start(1) + f.start()), f.group(), cmd)
                  for f in FLAG.finditer(m.group(1))]
        named.append(cmd)
        taken.append(m.span())
    for f in FLAG.finditer(text):
        if any(a <= f.start() < b for a, b in taken):
            continue
        before = [c for c, (a, _) in zip(named, taken) if a < f.start()]
        found.append(Flag(file, first_line + text.count("\n", 0, f.start()), f.group(), None, tuple(before)))
    return found


def collect(path: Path, text: str | None = None) -> list[Flag]:
    """Every flag a Markdown page writes, with what it belongs to."""
    name = str(path.relative_to(ROOT)) if path.is_absolute() and path.is_relative_to(ROOT) else str(path)
    lines = (text if text is not None else path.read_text()).split("\n")
    found: list[Flag] = []
    para: list[tuple[int, str]] = []
    before: list[tuple[str, str]] = []  # commands the last paragraph named: a block after it may be their output

    def end_paragraph() -> None:
        if para:
            text = "\n".join(t for _, t in para)
            found.extend(_prose(name, para[0][0], text))
            before[:] = [c for m in CODE_SPAN.finditer(text) if (c := command_of(m.group(1))) is not None]
            para.clear()

    i = 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            if lines[i].strip():
                para.append((i + 1, lines[i]))
            else:
                end_paragraph()
            i += 1
            continue
        end_paragraph()
        fence, lang = m.group(1), m.group(2).lower()
        body: list[tuple[int, str]] = []
        i += 1
        while i < len(lines) and not lines[i].strip().startswith(fence):
            body.append((i + 1, lines[i]))
            i += 1
        i += 1  # the closing fence
        if lang in SHELL_LANGS:
            for n, line in _logical_lines(body):
                cmd = command_of(line)
                found += _flags_at(name, n, line, cmd, [cmd] if cmd else [])
        else:  # Python, JSON, layouts, printed output: prose rules, line by line
            for n, line in body:
                found += _flags_at(name, n, line, None, before)
    end_paragraph()
    return found


# --- the check -----------------------------------------------------------------------------

# check passes unknown options to the engine of --reference engine
PASS_TO_VLLM = {"extract": ("engine",), "warmup": ("engine", "serve"), "serve": ("serve",), "check": ("engine",)}


def _accepts(cmd: tuple[str, str], cli: dict, vllm: dict, scripts: dict, pytest_opts: set[str]
             ) -> tuple[set[str] | None, str]:
    """The flags command `cmd` takes and how to name it, or None and why it is unknown."""
    kind, name = cmd
    if kind == "vllm-hidden":
        if name not in cli:
            return None, f"`vllm-hidden {name}` is not a subcommand (they are {sorted(k for k in cli if k)})"
        ok = cli[name] | cli[""]
        for part in PASS_TO_VLLM.get(name, ()):
            ok |= vllm[part]
        return ok, f"`vllm-hidden {name}`" + (" or vLLM" if name in PASS_TO_VLLM else "")
    if kind == "vllm":
        return vllm["serve"], "`vllm serve`"
    if kind == "script":
        if not (ROOT / name).is_file():
            return None, f"there is no script {name}"
        got = scripts.get(name)
        if got is None:
            return None, f"{name} parses no arguments"
        return got, name
    if kind == "pytest":
        return pytest_opts, "pytest"
    if kind == "trainer":
        return trainer_flags()[name], f"`{name}`"
    if kind in OTHER_TOOLS:
        return OTHER_TOOLS[kind], f"{kind} (OTHER_TOOLS in this test)"
    return None, f"the command {name!r} is not one this test knows"


def problems(flags: list[Flag], pytest_opts: set[str]) -> list[str]:
    """One line per flag no parser of its command knows: file, line, flag and why."""
    cli, vllm = ours(), vllm_flags()
    scripts = script_flags(sorted({c[1] for f in flags for c in (f.command, *f.context)
                                   if c is not None and c[0] == "script" and (ROOT / c[1]).is_file()}))
    every = set().union(*cli.values(), *vllm.values())

    def accepts(cmd: tuple[str, str]) -> tuple[set[str] | None, str]:
        return _accepts(cmd, cli, vllm, scripts, pytest_opts)

    out = []
    for f in flags:
        where = f"{f.file}:{f.line}: {f.flag}"
        if f.command is not None:
            ok, what = accepts(f.command)
            if ok is None:
                out.append(f"{where}: {what}")
            elif f.flag not in ok:
                out.append(f"{where}: not an option of {what}")
            continue
        if f.flag in every or f.flag in PROSE_ONLY:
            continue
        if any((ok := accepts(c)[0]) is not None and f.flag in ok for c in f.context):
            continue
        out.append(f"{where}: not an option of any vllm-hidden subcommand or of vLLM"
                   + (f", nor of {', '.join(accepts(c)[1] for c in f.context)} named before it" if f.context else ""))
    return out


def test_every_documented_flag_exists(pytestconfig):
    files = doc_files()
    assert (ROOT / "README.md").is_file() and len(files) >= 2, f"no docs found: {files}"
    flags = [f for p in files for f in collect(p)]
    assert len(flags) > 100, f"only {len(flags)} flags found in {[str(p) for p in files]}: is the scan broken?"
    bad = problems(flags, pytest_flags(pytestconfig))
    assert not bad, "flags in the docs that no parser knows:\n" + "\n".join(bad)


def test_the_parsers_are_read(pytestconfig):
    """The sets the check relies on hold what they must (a broken read would pass everything
    or fail everything)."""
    cli = ours()
    assert {"extract", "serve", "warmup", "inspect", "export"} <= set(cli)
    assert {"--model", "-m", "--resume", "--progress", "--no-progress", "--dp"} <= cli["extract"]
    assert "--max-hidden-tokens" in cli["serve"] and "--port" not in cli["serve"]
    v = vllm_flags()
    assert {"--max-model-len", "--enforce-eager", "--no-enable-chunked-prefill"} <= v["engine"]
    assert {"--port", "--api-key", "--middleware", "--max-model-len"} <= v["serve"]
    assert "--port" not in v["engine"]
    # pytest-timeout is a test dependency
    assert {"--durations", "--lf", "--timeout", "-k"} <= pytest_flags(pytestconfig)
    t = trainer_flags()
    assert {"--data-path", "--target-layer-ids", "--on-missing", "--verifier-name-or-path"} <= t["speculators train"]
    assert {"--config", "-c"} <= t["specforge train"] and "--data-path" not in t["specforge train"]


SAMPLE = """
# Title

`--max-model-len` is an engine flag, `--no-such-prose-flag` is not.

```bash
vllm-hidden extract --model M --input x --output o \\
    --resume --no-such-extract-flag
vllm-hidden serve M --port 8000 --no-such-serve-flag
vllm-hidden inspect out/ --port 8000
python scripts/bench.py --qwen36-27b --no-such-script-flag
ray start --head --no-such-ray-flag
speculators train --data-path d --no-such-speculators-flag
vllm serve M --middleware x --no-such-vllm-flag
VHIDDEN_X=1 scripts/test.sh tests/unit --durations 5 --no-such-pytest-flag
```

Run `python scripts/bench_writer.py --tail w-chat`, then `--tail` again and `--append`.

It prints the flags for `speculators train`:

```text
flags: --data-path d --no-such-printed-flag
```
"""


def test_the_check_finds_made_up_flags(pytestconfig):
    flags = collect(Path("sample.md"), SAMPLE)
    bad = problems(flags, pytest_flags(pytestconfig))
    found = {(b.split(":")[1], b.split(": ")[1]) for b in bad}
    assert found == {("4", "--no-such-prose-flag"), ("8", "--no-such-extract-flag"), ("9", "--no-such-serve-flag"),
                     ("10", "--port"), ("11", "--no-such-script-flag"), ("12", "--no-such-ray-flag"),
                     ("13", "--no-such-speculators-flag"), ("14", "--no-such-vllm-flag"),
                     ("15", "--no-such-pytest-flag"), ("18", "--append"),
                     ("23", "--no-such-printed-flag")}, "\n".join(bad)
    assert all(b.startswith("sample.md:") for b in bad)


@pytest.mark.parametrize("line,cmd", [
    ("vllm-hidden extract -m M", ("vllm-hidden", "extract")),
    ("VHIDDEN_X=1 scripts/test.sh tests/reliability", ("pytest", "")),
    ("python -m vllm_hidden.cli warmup --serve", ("vllm-hidden", "warmup")),
    ("python scripts/bench.py --append", ("script", "scripts/bench.py")),
    ("vllm serve MODEL --port 1", ("vllm", "serve")),
    ("speculators train --data-path d", ("trainer", "speculators train")),
    ("--max-tokens 256", None),
])
def test_command_of(line, cmd):
    assert command_of(line) == cmd
