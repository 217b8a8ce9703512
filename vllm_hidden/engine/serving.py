"""The vLLM side of the server: what the engine-client hook does (the `vllm-hidden serve`
launcher is server.launch).

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

import logging
from collections.abc import Callable
from typing import Any

log = logging.getLogger("vllm_hidden")
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

    from vllm_hidden.capture.server_env import channel_key
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
