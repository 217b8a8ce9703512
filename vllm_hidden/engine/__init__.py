"""The only package that imports vLLM: every vLLM attribute we replace or set (hooks), every
read of vLLM's private state and what differs between its versions (compat), plugin
registration, the model-runner capture and the worker RPCs, one engine running extract
(args, extractor, run, generate, scheduler), the server's engine hook and `serve` launcher,
and compile/kernel caches."""
