"""Shared pieces of the engine tests: run the real CLI, compute HF references."""

from __future__ import annotations

import blake3
import json
import os
import subprocess
import sys
from pathlib import Path

import torch


def run_cli(*args: str, timeout: int = 900) -> subprocess.CompletedProcess:
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1")}
    return subprocess.run([sys.executable, "-m", "vllm_hidden.cli", *args], capture_output=True, text=True,
                          timeout=timeout, env=env)


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
        return outs + [self._last[0]]


def rel_l2(got: torch.Tensor, ref: torch.Tensor) -> float:
    got, ref = got.float(), ref.float()
    return ((got - ref).norm() / ref.norm()).item()


def verify_checksums(out: Path) -> None:
    m = json.loads((out / "manifest.json").read_text())
    for s in m["shards"]:
        raw = (out / s["file"]).read_bytes()
        assert len(raw) == s["bytes"], s
        assert blake3.blake3(raw).hexdigest() == s["blake3"], s


class Server:
    """An OpenAI server in a subprocess on 127.0.0.1: `vllm-hidden serve` (layers given) or
    plain `vllm serve` (layers None). Output goes to `log`."""

    def __init__(self, model: Path, log: Path, layers: str | None, *args: str, api_key: str | None = None,
                 timeout: float = 600) -> None:
        import time
        import urllib.request

        from tests.s3_server import free_port

        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.api_key = api_key
        common = ["--host", "127.0.0.1", "--port", str(self.port), *args]
        if api_key:
            common += ["--api-key", api_key]
        if layers is not None:
            cmd = [sys.executable, "-m", "vllm_hidden.cli", "serve", str(model), "--layers", layers, *common]
        else:
            code = ("import sys; from vllm_hidden.engine.serving import run_vllm_serve; "
                    "run_vllm_serve(['serve', *sys.argv[1:]])")
            cmd = [sys.executable, "-c", code, str(model), *common]
        env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1")}
        for k in [k for k in env if k.startswith("VHIDDEN_")]:  # as from a shell: the server sets its own
            del env[k]
        self.log = log
        self._log_f = open(log, "w")
        self.proc = subprocess.Popen(cmd, stdout=self._log_f, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        deadline = time.time() + timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{log.read_text()[-4000:]}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if time.time() > deadline:
                self.stop()
                raise RuntimeError(f"server did not come up in {timeout} s:\n{log.read_text()[-4000:]}")
            time.sleep(1)

    def client(self, **kw):
        from openai import OpenAI

        return OpenAI(base_url=self.url + "/v1", api_key=self.api_key or "none", max_retries=0, **kw)

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
