"""PyTorch Dataset over an extract output directory (memory-mapped, lazy)."""

from __future__ import annotations

import bisect
import json
import os
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from vllm_hidden.storage.manifest import Manifest


class HiddenStatesDataset(torch.utils.data.Dataset):
    """`ds[i]` -> {"id", "token_ids" int64 [T], "hidden_states" [T, K, H]} with K in
    `ds.layer_ids` order. Shards are opened lazily per process, so the dataset can be
    handed to DataLoader workers."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        path = str(path)
        if path.startswith("s3://"):
            raise NotImplementedError(f"reading from S3 is not supported yet: {path!r}")
        self.root = Path(path)
        self.manifest = Manifest.read(self.root)
        self.layer_ids: list[int] = list(self.manifest.layer_ids)
        self._starts: list[int] = []
        n = 0
        for s in self.manifest.shards:
            self._starts.append(n)
            n += s.num_samples
        self._len = n
        self._open: dict[int, tuple[Any, list[list[Any]]]] = {}
        self._pid = os.getpid()

    def __len__(self) -> int:
        return self._len

    def _shard(self, k: int) -> tuple[Any, list[list[Any]]]:
        if self._pid != os.getpid():  # forked into a DataLoader worker: reopen there
            self._open.clear()
            self._pid = os.getpid()
        if k not in self._open:
            info = self.manifest.shards[k]
            f = safe_open(str(self.root / info.file), framework="pt")
            index = json.loads(f.metadata()["samples"])
            if len(index) != info.num_samples:
                raise ValueError(f"shard {info.file!r}: index has {len(index)} samples, manifest says {info.num_samples}")
            self._open[k] = (f, index)
        return self._open[k]

    def __getitem__(self, i: int) -> dict[str, Any]:
        if not -self._len <= i < self._len:
            raise IndexError(f"index {i} out of range for {self._len} samples")
        i %= self._len
        k = bisect.bisect_right(self._starts, i) - 1
        f, index = self._shard(k)
        sid, row, count = index[i - self._starts[k]]
        return {
            "id": sid,
            "token_ids": f.get_slice("token_ids")[row : row + count],
            "hidden_states": f.get_slice("hidden_states")[row : row + count],
        }

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_open"] = {}
        return state
