"""The only package that imports vLLM: plugin registration, the model-runner hook, the
worker RPCs, the extraction driver, and one version-compat module."""
