"""What the processes of one server share through the environment that vLLM's processes
inherit, set before vLLM starts them (by `vllm-hidden serve`, or, in a `vllm serve` naming
vllm_hidden in its arguments, by the plugin's registration, which vLLM runs while parsing
them; engine.plugin): the channel key, which proves a request came through an API server
process (the worker connects only where such a request says: capture.channel), and the
directory of the fetch form's states (server.store), with the sweep of those left by servers
that are gone."""

from __future__ import annotations

import atexit
import os
import secrets
import shutil
import tempfile
from pathlib import Path

import vllm_hidden.envs as envs

_PREFIX = "vllm-hidden-fetch-"


def channel_key() -> str | None:
    """A secret the API server's engine hook puts in each capture request and the worker
    checks: a client cannot reach the worker's capture through other endpoints' extra args."""
    return os.environ.get(envs.CHANNEL_KEY) or None


def ensure_key(fresh: bool = False) -> str:
    """The key for this server's processes, set in the environment so that the processes
    vLLM starts next inherit it."""
    if fresh or channel_key() is None:
        os.environ[envs.CHANNEL_KEY] = secrets.token_hex(16)
    return os.environ[envs.CHANNEL_KEY]


def default_parent() -> str:
    """/dev/shm when there is one (memory, shared by processes), else the temp directory."""
    shm = Path("/dev/shm")
    return str(shm) if shm.is_dir() and os.access(shm, os.W_OK) else tempfile.gettempdir()


def ensure_dir_env(parent: str | None = None, fresh: bool = False) -> str:
    """This server's directory (named, not made), in the environment the API server processes
    inherit. Directories left by servers that are gone are removed on the way."""
    current = None if fresh else os.environ.get(envs.FETCH_DIR)
    if current:
        return current
    parent = parent or default_parent()
    _remove_stale(Path(parent))
    path = os.path.join(parent, f"{_PREFIX}{os.getpid()}-{secrets.token_hex(6)}")
    os.environ[envs.FETCH_DIR] = path
    atexit.register(shutil.rmtree, path, ignore_errors=True)  # this process started the server
    return path


def _remove_stale(parent: Path) -> None:
    try:
        found = list(parent.glob(f"{_PREFIX}*"))
    except OSError:
        return
    for d in found:
        try:
            pid = int(d.name[len(_PREFIX):].split("-", 1)[0])
            os.kill(pid, 0)
        except ValueError:
            continue
        except ProcessLookupError:
            shutil.rmtree(d, ignore_errors=True)
        except PermissionError:  # another user's live server
            continue
