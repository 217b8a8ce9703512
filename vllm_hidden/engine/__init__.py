"""The vLLM adapter, the only package that imports vLLM: every vLLM attribute we replace or set
(hooks), every read of vLLM's private state and what differs between its versions (compat),
plugin registration, the model-runner capture and the worker RPCs, the engine's arguments and
scheduler, the server's engine hook and `serve` launcher, and compile/kernel caches. What drives
an engine through an extract run is `vllm_hidden.extract` (extractor, run, generate)."""
