"""PyTorch Dataset over an extract output: a local directory (memory-mapped, lazy) or
s3://bucket/prefix (each sample read with ranged GETs; shard headers cached per process)."""

from __future__ import annotations

import bisect
import json
import os
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from vllm_hidden.capture.quant import dequantize
from vllm_hidden.storage.manifest import MANIFEST, Manifest

_DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "I64": torch.int64, "U8": torch.uint8,
           "F8_E4M3": torch.float8_e4m3fn}
# what a shard may hold besides hidden_states and token_ids, returned under the same key
_OPTIONAL = ("final_hidden_states", "loss_mask", "hidden_states_scale", "final_hidden_states_scale")
_SCALED = (("hidden_states", "hidden_states_scale"), ("final_hidden_states", "final_hidden_states_scale"))


class HiddenStatesDataset(torch.utils.data.Dataset):
    """`ds[i]` -> {"id", "token_ids" int64 [T], "hidden_states" [T, K, H]} with K in
    `ds.layer_ids` order, plus "loss_mask" (bool [T]) and "final_hidden_states" ([T, H],
    after the model's final norm) when the output holds them, and "num_prompt_tokens" (int)
    in an `extract --generate` output. An fp8 output (`--storage-dtype fp8`) is returned
    dequantized to bf16 (value = fp8 * scale); `dequantize=False` returns the stored pairs,
    "hidden_states" float8 e4m3 [T, K, H] with "hidden_states_scale" float32 [T, K] (and
    "final_hidden_states" [T, H] with "final_hidden_states_scale" [T]). Row t of every tensor belongs
    to token t (unshifted: a trainer predicting token t+1 from row t shifts). Shards are
    opened lazily per process, so the dataset can be handed to DataLoader workers.

    A shard is checked when a process first opens it, and refused (ValueError naming it) if
    it differs from the manifest: its size always; with `verify` (the default) on a local
    output also its BLAKE3, which catches a flipped bit anywhere in the file (one pass over
    the file, multi-threaded, ~GB/s, leaving it in the page cache). On S3 only the size is
    checked here: `vllm-hidden inspect` hashes every object."""

    def __init__(self, path: str | os.PathLike[str], s3_endpoint_url: str | None = None, *,
                 verify: bool = True, dequantize: bool = True) -> None:
        path = str(path)
        self.verify = verify
        self.dequantize = dequantize
        self._s3 = None
        if path.startswith("s3://"):
            from vllm_hidden.storage.s3 import S3Location

            self._s3 = S3Location(path, s3_endpoint_url)
            self.root = Path(self._s3.prefix or ".")
            try:
                self.manifest = Manifest.from_dict(self._s3.get_json(MANIFEST))
            except self._s3.client.exceptions.NoSuchKey:
                raise FileNotFoundError(f"no {MANIFEST} under {path!r} (not an extract output, or the run "
                                        "did not finish)") from None
        else:
            self.root = Path(path)
            self.manifest = Manifest.read(self.root)
        self.layer_ids: list[int] = list(self.manifest.layer_ids)
        self._starts: list[int] = []
        n = 0
        for s in self.manifest.shards:
            self._starts.append(n)
            n += s.num_samples
        self._len = n
        self._open: dict[int, tuple[Any, list[list[Any]], list[str]]] = {}
        self._pid = os.getpid()

    def __len__(self) -> int:
        return self._len

    def _shard(self, k: int) -> tuple[Any, list[list[Any]], list[str]]:
        if self._pid != os.getpid():  # forked into a DataLoader worker: reopen there
            self._open.clear()
            self._pid = os.getpid()
            if self._s3 is not None:
                self._s3._client = None  # boto3 clients are not fork-safe
        if k not in self._open:
            info = self.manifest.shards[k]
            self._check(info)
            if self._s3 is not None:
                f, data_start = self._s3.safetensors_header(info.file)
                f["__data_start__"] = data_start
                index = json.loads(f["__metadata__"]["samples"])
                names = set(f)
            else:
                f = safe_open(str(self.root / info.file), framework="pt")
                index = json.loads(f.metadata()["samples"])
                names = set(f.keys())
            if len(index) != info.num_samples:
                raise ValueError(f"shard {info.file!r}: index has {len(index)} samples, manifest says {info.num_samples}")
            self._open[k] = (f, index, [n for n in _OPTIONAL if n in names])
        return self._open[k]

    def _check(self, info: Any) -> None:
        where = f"{self._s3.uri}/{info.file}" if self._s3 is not None else str(self.root / info.file)
        try:
            size = self._s3.size(info.file) if self._s3 is not None else (self.root / info.file).stat().st_size
        except FileNotFoundError:
            raise FileNotFoundError(f"shard {where!r} is listed in the manifest but missing") from None
        if size != info.bytes:
            raise ValueError(f"shard {where!r} has {size} bytes, the manifest says {info.bytes}: truncated or "
                             "replaced; `vllm-hidden inspect` checks them all")
        if self.verify and self._s3 is None:
            from vllm_hidden.storage.files import file_checksum

            if file_checksum(self.root / info.file) != info.blake3:
                raise ValueError(f"shard {where!r} does not match its BLAKE3 checksum in the manifest: corrupted on "
                                 "disk; `vllm-hidden inspect` checks them all")

    def __getitem__(self, i: int) -> dict[str, Any]:
        if not -self._len <= i < self._len:
            raise IndexError(f"index {i} out of range for {self._len} samples")
        i %= self._len
        k = bisect.bisect_right(self._starts, i) - 1
        f, index, optional = self._shard(k)
        entry = index[i - self._starts[k]]
        sid, row, count = entry[:3]
        out: dict[str, Any] = {"id": sid}
        if len(entry) > 3:  # --generate: rows [0, num_prompt_tokens) are the prompt, the rest the response
            out["num_prompt_tokens"] = entry[3]
        for name in ("token_ids", "hidden_states", *optional):
            if self._s3 is not None:
                out[name] = self._s3_rows(self.manifest.shards[k].file, f, name, row, count)
            else:
                out[name] = f.get_slice(name)[row : row + count]
        if "loss_mask" in out:
            out["loss_mask"] = out["loss_mask"].bool()
        if self.dequantize:
            for name, scale in _SCALED:
                if scale in out:
                    out[name] = dequantize(out[name], out.pop(scale))
        return out

    def _s3_rows(self, name: str, header: dict[str, Any], tensor: str, row: int, count: int) -> torch.Tensor:
        t = header[tensor]
        dtype, tail = _DTYPES[t["dtype"]], t["shape"][1:]
        row_bytes = dtype.itemsize
        for d in tail:
            row_bytes *= d
        start = header["__data_start__"] + t["data_offsets"][0] + row * row_bytes
        raw = self._s3.read_range(name, start, start + count * row_bytes)
        return torch.frombuffer(bytearray(raw), dtype=dtype).reshape(count, *tail)

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_open"] = {}
        if state.get("_s3") is not None:  # a boto3 client does not cross processes: a fresh one there
            from vllm_hidden.storage.s3 import S3Location

            state["_s3"] = S3Location(self._s3.uri, self._s3.endpoint_url)
        return state
