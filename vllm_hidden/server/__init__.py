"""OpenAI-compatible serving with hidden states: vLLM's own server plus
`HiddenStatesMiddleware` (load it with `--middleware vllm_hidden.server.HiddenStatesMiddleware`)."""

from vllm_hidden.server.protocol import decode

__all__ = ["HiddenStatesMiddleware", "decode"]


def __getattr__(name: str):
    if name == "HiddenStatesMiddleware":  # imported on use: it pulls in starlette-facing code
        from vllm_hidden.server.middleware import HiddenStatesMiddleware

        return HiddenStatesMiddleware
    raise AttributeError(name)
