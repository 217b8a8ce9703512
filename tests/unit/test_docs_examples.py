"""The docs' examples, run as written, without an engine (outputs are written by tests/outputs.py):

- every `vllm-hidden export` shell line of README.md and docs/*.md runs on an output shaped as
  the `vllm-hidden extract` line of the same block wrote it (its model's depth, `--layers`,
  `--final-state`, `--loss-mask`), or as `scripts/demo.sh` writes `.demo/out`; it must end as
  its `# exit N` comment says (0 without one), the message holding the text in backticks
  after it (`# exit 2: ` then the quote). Each export line is checked; one with neither source is an error here;
- the `specforge train` / `speculators train` lines and the printed-settings blocks after an
  export are what that export printed;
- README's reading example and training-data.md's collator example run on an output with the
  layers their page names, and give the samples' own values;
- docs/cli.md is what scripts/cli_reference.py writes from the CLI today, and names every
  option of every command.
"""

from __future__ import annotations

import difflib
import importlib.util
import inspect
import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

from tests.outputs import random_sample, write_output

ROOT = Path(__file__).resolve().parents[2]
FENCE = re.compile(r"^\s*(```|~~~)\s*([\w+-]*)")
SHELL = {"bash", "sh", "shell", "console"}

# What the docs' example commands name, as the docs say it: a model's depth and width, and the
# layer ids of the drafter config a `--layers-from` line names (SpecForge's
# configs/qwen3.6-27b-dflash.json).
MODELS = {"Qwen/Qwen3.6-27B": (64, 5120), "MODEL": (64, 5120)}
LAYERS_FROM = {"qwen3.6-27b-dflash.json": [1, 16, 31, 46, 61]}
DEMO_OUT = ".demo/out"


def doc_files() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


@dataclass
class Block:
    file: str
    lang: str
    lines: list[tuple[int, str]]  # (line number, text), shell continuations joined


def blocks(path: Path) -> list[Block]:
    """The page's fenced blocks in order."""
    out, lines, i = [], path.read_text().split("\n"), 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        fence, lang, start, body = m.group(1), m.group(2).lower(), i + 1, []
        i += 1
        while i < len(lines) and not lines[i].strip().startswith(fence):
            body.append((i + 1, lines[i]))
            i += 1
        i += 1
        if lang in SHELL:  # join `\` continuations
            joined, buf, first = [], "", None
            for n, text in body:
                first = n if first is None else first
                if text.rstrip().endswith("\\"):
                    buf += text.rstrip()[:-1] + " "
                    continue
                joined.append((first, buf + text))
                buf, first = "", None
            body = joined
        out.append(Block(path.name, lang, body or [(start, "")]))
    return out


def split(line: str) -> tuple[list[str], str]:
    """A shell line's words and its trailing comment (a line whose quoting shlex cannot close,
    such as a JSON body spread over lines, split on blanks: it is none of the commands read here)."""
    try:
        words = shlex.split(line, posix=True)
    except ValueError:
        words = line.split()
    if "#" in words:
        k = words.index("#")
        return words[:k], " ".join(words[k + 1:])
    return words, ""


def options(words: list[str], with_value: set[str], aliases: dict[str, str]) -> tuple[list[str], dict[str, str]]:
    """(positional words, {option: value}) of a command's words after the subcommand."""
    pos, opts, i = [], {}, 0
    while i < len(words):
        w = aliases.get(words[i], words[i])
        if w in with_value:
            opts[w] = words[i + 1]
            i += 2
        elif w.startswith("-"):
            opts[w] = ""
            i += 1
        else:
            pos.append(w)
            i += 1
    return pos, opts


def ids(spec: str) -> list[int]:
    return [int(x) for x in spec.split(",")]


@dataclass
class Shape:
    """What an output holds, as the extract that wrote it was told."""

    model: str
    num_layers: int
    hidden: int
    layers: list[int]
    final: bool
    mask: str = "default"

    def write(self, root: Path, n: int = 3) -> dict[str, tuple]:
        samples = {}
        for i in range(n):
            t = 5 + 2 * i
            tok, hs, *fin = random_sample(i, t, len(self.layers), self.hidden, final=self.final)
            samples[f"s{i}"] = (tok, hs, fin[0] if fin else None, None if self.mask == "none" else [[1, t]])
        write_output(root, self.layers, self.hidden, samples, final_state=self.final, loss_mask=self.mask != "none",
                     manifest={"model": self.model, "num_model_layers": self.num_layers,
                               "final_state": "post-norm" if self.final else "none",
                               "input": {"loss_mask": self.mask}})
        return samples


def extract_shape(words: list[str]) -> tuple[str, Shape]:
    """(the output location, what it holds) of a `vllm-hidden extract` line's words."""
    _, o = options(words[2:], {"--model", "--input", "--output", "--layers", "--layers-from", "--final-state",
                               "--loss-mask", "--max-model-len", "--max-tokens", "--temperature"},
                   {"-m": "--model", "-i": "--input", "-o": "--output"})
    model = o["--model"]
    assert model in MODELS, f"an example extracts from {model!r}: add its depth and width to MODELS"
    n, h = MODELS[model]
    if "--layers" in o:
        layers = ids(o["--layers"])
    elif "--layers-from" in o:
        layers = LAYERS_FROM[Path(o["--layers-from"]).name]
    else:
        layers = [1, 16, 31, 46, 61] if n == 64 else pytest.fail(f"no default layers known for {model}")
    return o["--output"], Shape(model, n, h, layers, o.get("--final-state") == "post-norm",
                                o.get("--loss-mask", "assistant"))


def demo_shape() -> Shape:
    """`.demo/out` as scripts/demo.sh writes it: its extract's layers and final state, and the
    depth of the tiny model it extracts from (make_tiny_model's default)."""
    from vllm_hidden.demo import make_tiny_model

    src = (ROOT / "scripts" / "demo.py").read_text()
    layers = re.search(r'"--layers",\s*"([\d,]+)"', src)
    final = re.search(r'"--final-state",\s*"([\w-]+)"', src)
    assert layers and final, "scripts/demo.py no longer passes --layers and --final-state as this test reads them"
    depth = inspect.signature(make_tiny_model).parameters["num_layers"].default
    return Shape(".demo/model", depth, 256, ids(layers.group(1)), final.group(1) == "post-norm")


def run_cli(*args: str):
    from typer.testing import CliRunner

    from vllm_hidden.cli import app

    r = CliRunner().invoke(app, list(args))
    if r.exception is not None and not isinstance(r.exception, SystemExit):
        raise r.exception
    return r


@dataclass
class Export:
    where: str
    line: str
    code: int
    stderr: str
    expect: tuple[int, str | None] = (0, None)


@dataclass
class Page:
    exports: list[Export] = field(default_factory=list)
    trainer_lines: list[tuple[str, str, Export | None]] = field(default_factory=list)  # (where, line, last export)
    printed: list[tuple[str, list[str], Export | None]] = field(default_factory=list)  # (where, block, last export)


def run_page(path: Path, work: Path, monkeypatch) -> Page:
    """Every export line of the page run where its block's extract (or the demo) left an
    output, each block in a directory of its own; trainer lines and printed blocks kept with
    the export before them."""
    page, last = Page(), None
    for b, block in enumerate(blocks(path)):
        if block.lang not in SHELL:
            text = [t for _, t in block.lines]
            if text and text[0].startswith("exported "):
                page.printed.append((f"{block.file}:{block.lines[0][0]}", text, last))
            continue
        cwd = work / f"{path.stem}-{b}"
        cwd.mkdir(parents=True)
        monkeypatch.chdir(cwd)
        extracts: dict[str, list[str]] = {}  # output -> its extract line's words (a synopsis is never read)
        made: dict[str, Path] = {}
        for n, line in block.lines:
            words, comment = split(line) if line.strip() else ([], "")
            where = f"{block.file}:{n}"
            if words[:2] == ["vllm-hidden", "extract"]:
                out = next((w for a, w in zip(words, words[1:]) if a in ("-o", "--output")), None)
                if out is not None:
                    extracts[out] = words
            elif words[:2] == ["vllm-hidden", "export"]:
                pos, o = options(words[2:], {"--to", "--layers", "--s3-endpoint-url"}, {})
                src, dest = pos
                if src not in made and (src in extracts or src == DEMO_OUT):
                    made[src] = cwd / "outputs" / re.sub(r"\W+", "_", src)
                    (extract_shape(extracts[src])[1] if src in extracts else demo_shape()).write(made[src])
                assert src in made, (f"{where}: `{line.strip()}` exports {src!r}, which no extract line of its "
                                     f"block writes (nor is it {DEMO_OUT}): this test cannot run it")
                code = re.search(r"exit (\d+)(?::\s*`([^`]+)`)?", comment)  # `# exit 2: `what it says``
                assert code or src != DEMO_OUT, f"{where}: say how the export on the demo's output ends: # exit N"
                args = ["export", str(made[src]), "--to", o["--to"], dest, "--no-progress"]
                args += ["--layers", o["--layers"]] if "--layers" in o else []
                r = run_cli(*args)
                last = Export(where, line.strip(), r.exit_code, r.stderr,
                              (int(code.group(1)), code.group(2)) if code else (0, None))
                page.exports.append(last)
            elif words[:2] in (["specforge", "train"], ["speculators", "train"]):
                page.trainer_lines.append((where, " ".join(words), last))
    return page


@pytest.fixture(scope="module")
def pages(tmp_path_factory) -> dict[str, Page]:
    work = tmp_path_factory.mktemp("docs-examples")
    with pytest.MonkeyPatch.context() as mp:
        return {p.name: run_page(p, work, mp) for p in doc_files()}


def test_every_export_example_ends_as_the_docs_say(pages):
    exports = [e for p in pages.values() for e in p.exports]
    # the pages that show exports: at least the README's, the per-trainer ones and the demo's
    assert len(exports) >= 8 and {e.where.split(":")[0] for e in exports} >= {"README.md", "train-a-drafter.md"}
    assert any(e.expect[0] != 0 for e in exports), "no failing example left: is the demo's speculators line gone?"
    bad = []
    for e in exports:
        want, quoted = e.expect
        if e.code != want:
            bad.append(f"{e.where}: `{e.line}` exited {e.code}, the docs say {want}:\n{e.stderr}")
        elif quoted and quoted not in e.stderr:
            bad.append(f"{e.where}: `{e.line}` did not say {quoted!r}:\n{e.stderr}")
    assert not bad, "\n".join(bad)


def _printed_command(e: Export, trainer: str) -> str:
    lines = [x.strip() for x in e.stderr.splitlines()]
    if trainer == "specforge train":
        return next(x for x in lines if x.startswith("specforge train "))
    flags = next(x for x in lines if x.startswith("flags: "))[len("flags: "):]
    return "speculators train " + re.sub(r"\s*\([^()]*\)$", "", flags)  # the note after the flags is for people


def test_trainer_commands_are_what_the_export_printed(pages):
    checked, bad = 0, []
    for page in pages.values():
        for where, line, e in page.trainer_lines:
            if e is None:  # a trainer line on a page without an export before it (online training)
                continue
            assert e.code == 0, f"{where}: the export before `{line}` failed:\n{e.stderr}"
            want = _printed_command(e, " ".join(line.split()[:2]))
            checked += 1
            if line != want:
                bad.append(f"{where}: `{line}`\n  the export at {e.where} printed `{want}`")
    assert checked >= 3, f"only {checked} trainer commands found after an export"
    assert not bad, "\n".join(bad)


def test_printed_settings_blocks_are_what_the_export_printed(pages):
    checked, bad = 0, []
    for page in pages.values():
        for where, text, e in page.printed:
            assert e is not None and e.code == 0, f"{where}: a printed block without a successful export before it"
            got = e.stderr.rstrip("\n").split("\n")
            checked += 1
            if not re.fullmatch(r"exported \d+ samples, \d+ tokens", text[0]) or text[1:] != got[1:]:
                bad.append(f"{where}: the block differs from what {e.where} printed:\n"
                           + "\n".join(difflib.unified_diff(text, got, "docs", "printed", lineterm="")))
    assert checked >= 2, f"only {checked} printed-settings blocks found"
    assert not bad, "\n".join(bad)


def python_block(page: str, marker: str) -> tuple[str, str]:
    """(the text before the first Python block of `page` holding `marker`, its code)."""
    text = (ROOT / page).read_text()
    m = next((m for m in re.finditer(r"```python\n(.*?)```", text, re.S) if marker in m.group(1)), None)
    assert m is not None, f"{page}: no python block with {marker!r}"
    return text[:m.start()], m.group(1)


def test_the_collator_example_runs_as_written(tmp_path, monkeypatch):
    before, code = python_block("docs/training-data.md", "DFlashCollator(")
    extract = re.findall(r"`(vllm-hidden extract [^`]+)`", before)[-1]  # the extract the page says made "out/"
    out, shape = extract_shape(shlex.split(extract))
    assert out.rstrip("/") == "out" and '"out/"' in code
    shape.hidden = 8
    monkeypatch.chdir(tmp_path)
    samples = shape.write(tmp_path / "out", n=3)
    ns: dict = {}
    exec(compile(code, "docs/training-data.md", "exec"), ns)
    use = {name: ids(m.replace(" ", "")) for name, m in re.findall(r"(\w+) = DataLoader\(.*?use=\[([\d, ]+)\]", code)}
    assert set(use) == {"dflash", "eagle3"}, use
    h, rows = shape.hidden, list(samples.values())
    for name, layers in use.items():
        batch = next(iter(ns[name]))
        assert batch["input_ids"].shape[0] == len(rows)
        wide = batch["hidden_states" if name == "dflash" else "aux_hidden_state"]
        assert wide.shape[-1] == len(layers) * h
        for b, (tok, hs, final, spans) in enumerate(rows):
            t = tok.shape[0]
            assert torch.equal(batch["input_ids"][b, :t], tok)
            for k, layer in enumerate(layers):  # the drafter's order, each the output's own column
                assert torch.equal(wide[b, :t, k * h:(k + 1) * h], hs[:, shape.layers.index(layer)])
            mask = torch.zeros(t, dtype=torch.bool)
            mask[spans[0][0]:spans[0][1]] = True
            assert torch.equal(batch["loss_mask"][b, :t].bool(), mask)
            if name == "eagle3":
                assert torch.equal(batch["hidden_state"][b, :t], final)


def test_the_readme_reading_example_runs_as_written(tmp_path, monkeypatch):
    _, code = python_block("README.md", "HiddenStatesDataset(")
    shape = Shape("m", 64, 8, [1, 16, 31, 46, 61], final=False)
    monkeypatch.chdir(tmp_path)
    samples = shape.write(tmp_path / "out", n=2)
    ns: dict = {}
    exec(compile(code, "README.md", "exec"), ns)
    s, (tok, hs, _, _) = ns["s"], samples["s0"]
    assert len(ns["ds"]) == 2 and list(ns["ds"].layer_ids) == shape.layers
    assert s["id"] == "s0" and torch.equal(s["token_ids"], tok) and torch.equal(s["hidden_states"], hs)


def _cli_reference():
    spec = importlib.util.spec_from_file_location("cli_reference", ROOT / "scripts" / "cli_reference.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_the_cli_reference_is_up_to_date():
    page = (ROOT / "docs" / "cli.md").read_text()
    now = _cli_reference().render()
    diff = "\n".join(list(difflib.unified_diff(page.splitlines(), now.splitlines(), "docs/cli.md", "the CLI now",
                                               lineterm=""))[:60])
    assert page == now, f"docs/cli.md is out of date: run python scripts/cli_reference.py\n{diff}"


def test_the_cli_reference_names_every_option_of_every_command():
    """Read from the CLI's command objects, not from the generator: a command or an option the
    page leaves out fails here even if the generator dropped it."""
    import typer.main

    from vllm_hidden.cli import app

    page = (ROOT / "docs" / "cli.md").read_text()
    sections = dict(re.findall(r"^## `vllm-hidden ?([\w-]*)`\n(.*?)(?=^## |\Z)", page, re.M | re.S))
    group = typer.main.get_command(app)
    top = group.context_class(group, info_name="vllm-hidden")
    commands = {"": (group, top), **{n: (c, c.context_class(c, info_name=n, parent=top))
                                     for n, c in group.commands.items()}}
    assert set(sections) == set(commands), (sorted(sections), sorted(commands))
    missing = [f"{name or 'vllm-hidden'}: {o}" for name, (cmd, ctx) in commands.items()
               for p in cmd.get_params(ctx) for o in (*p.opts, *p.secondary_opts)
               if o != "--help" and f"`{o if o.startswith('-') else o.upper()}`" not in sections[name]]
    assert not missing, f"docs/cli.md leaves out: {missing}"
