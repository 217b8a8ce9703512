"""The base of vllm-hidden's own errors. The CLI reports one in a line, without a traceback,
and exits with its `exit_code`: 2 for what the user can fix (bad input or configuration, a
missing package, storage that failed: rerun with --resume), None for a bug, which keeps its
traceback. Each subclass also derives from the builtin error it always was (ValueError,
RuntimeError, ImportError), so code catching those still catches it."""

from __future__ import annotations


class VllmHiddenError(Exception):
    exit_code: int | None = 2
