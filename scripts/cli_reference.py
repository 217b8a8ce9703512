"""Write docs/cli.md, the command-line reference, from the typer app itself: every subcommand,
its arguments and options, each option's type, default and help text as the parser holds
them. tests/unit/test_docs_examples.py fails when the page differs from what this writes.

    python scripts/cli_reference.py          # rewrite docs/cli.md
    python scripts/cli_reference.py --check  # exit 1 if docs/cli.md is out of date
"""

from __future__ import annotations

import argparse
import sys
import types
import typing
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "cli.md"

# Where a subcommand passes options it does not know (its context_settings allow extra args).
PASSED_ON = {
    "extract": "vLLM's engine arguments (`vllm serve --help` lists them; e.g. `--enforce-eager`, "
               "`--gdn-prefill-backend triton`, `--language-model-only`)",
    "warmup": "vLLM's engine arguments, as `extract` passes them (with `--serve`: `vllm serve`'s options)",
    "serve": "`vllm serve` (e.g. `--port`, `--api-key`, `--tensor-parallel-size`, `--max-model-len`)",
    "check": "the plain vLLM engine of `--reference engine` (the output's dtype and online `--quantization` "
             "are added unless given)",
}

_TYPES = {str: "TEXT", int: "INTEGER", float: "FLOAT", Path: "PATH", bool: "BOOLEAN"}


def _annotation(p: Any) -> Any:
    """The Python type a parameter parses to (Optional and list unwrapped)."""
    desc = getattr(p, "type_descriptor", None)
    ann = getattr(desc, "annotation", None)
    if ann is None:  # a click parameter without typer's descriptor: its click type's name
        return getattr(getattr(p, "type", None), "name", "TEXT").upper()
    while typing.get_origin(ann) in (typing.Union, types.UnionType, list):
        ann = next(a for a in typing.get_args(ann) if a is not type(None))
    return ann


def _type(p: Any) -> str:
    if getattr(p, "is_flag", False):
        return "flag"
    ann = _annotation(p)
    name = ann if isinstance(ann, str) else _TYPES.get(ann, getattr(ann, "__name__", str(ann)).upper())
    return f"{name}, repeatable" if getattr(p, "multiple", False) else name


def _default(p: Any) -> str:
    if getattr(p, "required", False):
        return "required"
    d = p.default
    if getattr(p, "is_flag", False):
        if p.secondary_opts:  # --x/--no-x
            return f"`{p.opts[0] if d else p.secondary_opts[0]}`"
        return "on" if d else "off"
    if d is None or d == [] or d == ():
        return "none"
    if isinstance(d, int) and not isinstance(d, bool) and d >= 1 << 20 and d % (1 << 20) == 0:
        size = f"{d >> 30} GiB" if d % (1 << 30) == 0 else f"{d >> 20} MiB"
        return f"`{d}` ({size})"
    return f"`{d}`"


def _cell(text: str | None) -> str:
    """Help text as one Markdown table cell."""
    return " ".join((text or "").split()).replace("|", "\\|")


def _params(cmd: Any, ctx: Any) -> tuple[list[Any], list[Any]]:
    params = [p for p in cmd.get_params(ctx) if "--help" not in p.opts]
    args = [p for p in params if not any(o.startswith("-") for o in p.opts)]
    return args, [p for p in params if p not in args]


def _options_table(options: list[Any]) -> list[str]:
    lines = ["| option | type | default | meaning |", "| --- | --- | --- | --- |"]
    for p in options:
        names = ", ".join(f"`{o}`" for o in [*p.opts, *p.secondary_opts])
        lines.append(f"| {names} | {_type(p)} | {_default(p)} | {_cell(p.help)} |")
    return lines


def _command(name: str, cmd: Any, ctx: Any) -> list[str]:
    args, options = _params(cmd, ctx)
    usage = " ".join(["vllm-hidden", name, "[OPTIONS]", *(p.name.upper() for p in args)])
    if name in PASSED_ON:
        usage += " [OTHER OPTIONS]"
    out = [f"## `vllm-hidden {name}`", "", "```", usage, "```", "", _cell(cmd.help), ""]
    if args:
        out += ["| argument | meaning |", "| --- | --- |",
                *(f"| `{p.name.upper()}` | {_cell(p.help)} |" for p in args), ""]
    out += [*_options_table(options), ""]
    if name in PASSED_ON:
        out += [f"Any other option goes to {PASSED_ON[name]}.", ""]
    return out


def render() -> str:
    """docs/cli.md as the installed CLI defines it."""
    import typer.main

    from vllm_hidden.cli import app

    group = typer.main.get_command(app)
    top = group.context_class(group, info_name="vllm-hidden")
    _, top_options = _params(group, top)
    out = ["# Command-line reference", "",
           "Generated from the `vllm-hidden` command itself by `python scripts/cli_reference.py`; "
           "`tests/unit/test_docs_examples.py` fails when this page and the CLI differ, so edit the help "
           "texts in `vllm_hidden/cli.py` and run the script again rather than editing this page. Every "
           "command also takes `--help`. What the options do in depth: [extract](extract.md), "
           "[serve](serve.md), [warmup](warmup.md), [check](check.md), [export](train-a-drafter.md), "
           "[inspect](storage-and-resume.md); error messages and exit codes: "
           "[troubleshooting](troubleshooting.md).", "",
           "Commands: " + ", ".join(f"[`{n}`](#vllm-hidden-{n})" for n in group.commands) + ".", "",
           "## `vllm-hidden`", "", "```", "vllm-hidden [OPTIONS] COMMAND [ARGS]...", "```", "",
           _cell(group.help), "", *_options_table(top_options), ""]
    for name, cmd in group.commands.items():
        out += _command(name, cmd, cmd.context_class(cmd, info_name=name, parent=top))
    return "\n".join(out).rstrip("\n") + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description="Write docs/cli.md from the vllm-hidden CLI.")
    ap.add_argument("--check", action="store_true", help="exit 1 if docs/cli.md is out of date, writing nothing")
    a = ap.parse_args()
    page = render()
    if a.check:
        if not PAGE.is_file() or PAGE.read_text() != page:
            print(f"{PAGE.relative_to(ROOT)} is out of date: run python scripts/cli_reference.py", file=sys.stderr)
            return 1
        return 0
    PAGE.write_text(page)
    print(f"wrote {PAGE.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
