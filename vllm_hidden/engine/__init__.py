"""The only package that imports vLLM: plugin registration, the model-runner hook, the
worker RPCs, one engine running prefill-only capture (extractor), the server's engine hook
and `serve` launcher, compile/kernel caches, and one version-compat module."""
