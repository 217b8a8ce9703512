"""What an extract is, worked out and checked before any engine starts: the model's shape,
the layer ids, the longest prompt, the output's identity (run.json), the input and output
paths, every record of the input (short of tokenizing), and for engines started elsewhere
their options. Reads the model's config with Transformers; vLLM only through engine.args."""

from __future__ import annotations

import logging
import os
import tempfile
from pathlib import Path

from vllm_hidden.config import ExtractConfig, ModelInfo, Plan
from vllm_hidden.engine.quant import quantization_arg
from vllm_hidden.format.shard import FORMAT
from vllm_hidden.inputs import InputScan, PromptReader, parse_columns, scan_input
from vllm_hidden.inputs.sources import check_input
from vllm_hidden.layers import layer_source, layers_to_run, moe_layer_indices, resolve_layer_ids
from vllm_hidden.storage.journal import RUN
from vllm_hidden.storage.s3 import S3Location, is_s3

log = logging.getLogger("vllm_hidden")


def model_info(model: str) -> ModelInfo:
    from transformers import AutoConfig

    try:
        cfg = AutoConfig.from_pretrained(model)
    except Exception as e:  # noqa: BLE001 - re-raised with the model named
        raise ValueError(f"cannot read the model config of {model!r}: {e}") from None
    text = cfg.get_text_config()
    return ModelInfo(
        num_layers=int(text.num_hidden_layers),
        hidden_size=int(text.hidden_size),
        vocab_size=int(text.vocab_size),
        max_positions=getattr(text, "max_position_embeddings", None),
        moe_layers=moe_layer_indices(text),
    )


def check_paths(model: str, input_path: str | None, output_dir: str | None, resume: bool = False,
                s3_endpoint_url: str | None = None, input_columns: dict[str, str] | None = None) -> None:
    """Fail before the (slow) engine start on anything we can check up front (input and
    output: unless None, as in a data-parallel rank, whose coordinator checked them)."""
    if input_path is not None:
        if not Path(input_path).is_file():
            raise ValueError(f"--input: no such file {input_path!r}")
        check_input(input_path, parse_columns(input_columns))
    if (model.startswith((".", "/", "~")) or Path(model).exists()) and not Path(model).expanduser().is_dir():
        raise ValueError(f"--model: no such model directory {model!r}")
    if output_dir is None:
        return
    if is_s3(output_dir):
        loc = S3Location(output_dir, s3_endpoint_url)
        try:
            names = loc.names()
        except Exception as e:  # noqa: BLE001 - re-raised with the location named
            raise ValueError(f"--output: cannot list {loc.uri!r}: {e}") from None
        if names and not resume:
            raise ValueError(f"--output: {loc.uri!r} is not empty; pass --resume to continue the run that wrote it, "
                             "or choose a new prefix")
        if names and RUN not in names:
            raise ValueError(f"--resume: {loc.uri!r} is not empty and has no {RUN}; it is not a vllm-hidden output")
        return
    out = Path(output_dir)
    if out.exists() and not out.is_dir():
        raise ValueError(f"--output: {output_dir!r} is not a directory")
    _probe_writable(out, output_dir)
    if out.exists() and any(out.iterdir()):
        if not resume:
            raise ValueError(f"--output: {output_dir!r} exists and is not empty; pass --resume to continue the "
                             "run that wrote it, or choose a new directory")
        if not (out / RUN).is_file():
            raise ValueError(f"--resume: {output_dir!r} is not empty and has no {RUN}; it is not a vllm-hidden output")


def _probe_writable(out: Path, given: str) -> None:
    """Write a file in the output directory (created for the test) now, not after the engine
    start: permissions mean little to root, and a read-only mount or a path through a file
    is found only by trying."""
    created = []  # removed again: a run refused later (or never started) leaves nothing behind
    p = out
    while not p.exists() and p != p.parent:
        created.append(p)
        p = p.parent
    try:
        out.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".vllm-hidden-probe-", dir=out)
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise ValueError(f"--output: cannot write to {given!r}: {e.strerror or e}") from None
    finally:
        for d in created:
            try:
                d.rmdir()
            except OSError:
                pass


def plan_extract(cfg: ExtractConfig) -> Plan:
    info = model_info(cfg.model)
    layer_ids = resolve_layer_ids(info.num_layers, cfg.layers, cfg.aux_layers, cfg.layers_from)
    if cfg.max_model_len and info.max_positions and cfg.max_model_len > info.max_positions:
        raise ValueError(f"--max-model-len {cfg.max_model_len} is above the model's limit of "
                         f"{info.max_positions} positions")
    max_len = cfg.max_model_len or info.max_positions
    if not max_len:
        raise ValueError(f"--max-model-len is required: {cfg.model!r} does not state max_position_embeddings")
    max_prompt_len = max_len
    if cfg.generate is not None:  # prompt + response within --max-model-len
        max_prompt_len = max_len - cfg.generate.max_tokens
        if max_prompt_len < 1:
            raise ValueError(f"--max-tokens {cfg.generate.max_tokens} leaves no room for a prompt within "
                             f"--max-model-len {max_len}")
    m = cfg.model
    model = str(Path(m).expanduser().resolve()) if Path(m).expanduser().is_dir() else m
    identity = {"format": FORMAT, "model": model, "layer_ids": list(layer_ids), "hidden_size": info.hidden_size,
                "final_state": cfg.final_state, "loss_mask": cfg.loss_mask or "default",
                "generate": cfg.generate.to_dict() if cfg.generate is not None else None,
                **({"storage_dtype": cfg.storage_dtype} if cfg.storage_dtype != "auto" else {})}
    q = quantization_arg(cfg.engine_args)
    if q:  # an online-quantized target computes other states: a resume must not mix them with bf16 ones
        identity["quantization"] = q
    # not part of the identity: a cut model computes the captured layers exactly as the whole one
    layers_run = layers_to_run(info.num_layers, layer_ids, info.moe_layers, full=cfg.needs_full_model)
    return Plan(info=info, layer_ids=list(layer_ids), max_prompt_len=max_prompt_len, identity=identity,
                layers_run=layers_run,
                layer_source=layer_source(info.num_layers, cfg.layers, cfg.aux_layers, cfg.layers_from))


def check_prompts(cfg: ExtractConfig, plan: Plan, input_path: str | None = None) -> InputScan:
    """The up-front pass over the prompt file (inputs.scan), with the reader the run will use
    but a tokenizer it never loads: a systematic mistake (no record, or the first records all
    bad) is a ValueError before any engine starts and before anything is written; isolated bad
    records are logged with the first of them (the run skips them, as errors.jsonl)."""
    scan = scan_input(prompt_reader(cfg, plan, input_path))
    (log.warning if scan.bad else log.info)("vllm-hidden: %s", scan.describe())
    return scan


def check_engine_options(cfg: ExtractConfig, plan: Plan) -> None:
    """The engine options through vLLM's own parser and our rules on them, as each engine will
    take them, for a run whose engines start elsewhere (--dp, --ray): a misspelled option is
    refused here, before run.json, not by every rank after it. Reads no model and starts
    nothing (vLLM's modules are imported)."""
    from vllm_hidden.engine import compat
    from vllm_hidden.engine.args import check_cli, parse_cli

    args = parse_cli(cfg.model, cfg.engine_args)
    check_cli(args, prefix_cache=cfg.generate is not None)
    if cfg.ray_address is None and cfg.generate is not None and cfg.generate.seed is not None:
        compat.check_seeded_generation(args)  # the engines start on this host (Ray's elsewhere)


def prompt_reader(cfg: ExtractConfig, plan: Plan, input_path: str | None = None) -> PromptReader:
    from transformers import AutoTokenizer

    return PromptReader(input_path or cfg.input_path, vocab_size=plan.info.vocab_size,
                        max_prompt_len=plan.max_prompt_len,
                        tokenizer_loader=lambda: AutoTokenizer.from_pretrained(cfg.model),
                        loss_mask=cfg.loss_mask, columns=parse_columns(cfg.input_columns),
                        room=cfg.generate.max_tokens if cfg.generate is not None else None,
                        regenerate=cfg.generate.regenerate if cfg.generate is not None else "last")
