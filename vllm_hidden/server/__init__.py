"""OpenAI-compatible serving with hidden states: vLLM's own server plus
`HiddenStatesMiddleware` (load it with `--middleware vllm_hidden.server.HiddenStatesMiddleware`).
Client helpers: `decode(obj)` for the inline form, `fetch(client_or_url, obj)` for the fetch
form; both return {"hidden_states": [T, K, H], "token_ids": [T]}."""

from vllm_hidden.server.protocol import decode, fetch

__all__ = ["HiddenStatesMiddleware", "decode", "fetch"]


def __getattr__(name: str):
    if name == "HiddenStatesMiddleware":  # imported on use: it pulls in starlette-facing code
        from vllm_hidden.server.middleware import HiddenStatesMiddleware

        return HiddenStatesMiddleware
    raise AttributeError(name)
