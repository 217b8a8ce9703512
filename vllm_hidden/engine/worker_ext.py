"""RPCs the driver calls on the workers (`worker_extension_cls`: vLLM mixes this class into
its Worker, so `collective_rpc("vllm_hidden_open", ...)` reaches these methods)."""

from __future__ import annotations

from typing import Any

from vllm_hidden.engine import compat


class HiddenStatesWorkerExtension:
    def _vllm_hidden(self):
        cap = getattr(compat.worker_model_runner(self), "vllm_hidden_capture", None)
        if cap is None:
            raise RuntimeError("vllm-hidden capture is not installed in this engine (no additional_config)")
        return cap

    def vllm_hidden_open(self, shard_cfg: dict[str, Any]) -> bool:
        from vllm_hidden.config import ShardConfig

        return self._vllm_hidden().open(ShardConfig(**shard_cfg))

    def vllm_hidden_open_device(self, final_state: bool):
        """Colocated (`vllm_hidden.colocate`): the engine runs in the caller's process, so the
        reply is the device sink itself, not a copy of it."""
        return self._vllm_hidden().open_device(final_state)

    def vllm_hidden_close(self) -> dict[str, Any] | None:
        return self._vllm_hidden().close()

    def vllm_hidden_generated(self, ends: list[dict[str, Any]]) -> None:
        self._vllm_hidden().generated(ends)

    def vllm_hidden_status(self) -> dict[str, Any] | None:
        return self._vllm_hidden().status()

    def vllm_hidden_start_report(self) -> dict[str, Any] | None:
        """What this engine's start compiled (`caches.StartProbe`); None off the writer rank."""
        cap = self._vllm_hidden()
        return cap.start_report if cap.writer_rank else None
