"""PyTorch Dataset over an extract output: a local directory or s3://bucket/prefix, read one
sample at a time (its rows of each tensor, nothing else), each sample verified against the
checksum recorded when it was written. See `stream.py` for shard-aware shuffling across ranks
and DataLoader workers, and token-budget batches."""

from __future__ import annotations

import bisect
import logging
import os
import threading
import weakref
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from vllm_hidden.data.batches import alloc_tensor, returned_dtype
from vllm_hidden.format.quant import dequantize
from vllm_hidden.format.shard import FINAL, HIDDEN, SCALES, ShardHeader, sample_digest
from vllm_hidden.storage.manifest import MANIFEST, Manifest

log = logging.getLogger("vllm_hidden")

# per-token rows large enough to read per sample everywhere; the others (ids, mask, fp8 scales,
# a few bytes per token) are read per sample from local files, and once per shard from S3,
# where a request costs more than their bytes
_LARGE = (HIDDEN, FINAL)
_OPEN_SHARDS = 256  # shards a process keeps open (parsed header, file); the least recently used go first

# (name, stored dtype, shape) -> the tensor a sample's rows of that tensor are read into
Alloc = Callable[[str, torch.dtype, tuple[int, ...]], torch.Tensor]


def as_bytes(t: torch.Tensor) -> memoryview:
    """A contiguous tensor's bytes, writable, without a copy."""
    return memoryview(t.view(torch.uint8).reshape(-1).numpy())


def new_tensor(name: str, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    return alloc_tensor(shape, returned_dtype(name, dtype))


class _Shard:
    """One shard as a process reads it: its header (index, per-sample checksums, tensor
    layout), and where its bytes come from (a file descriptor, or ranged GETs)."""

    def __init__(self, ds: "HiddenStatesDataset", k: int) -> None:
        info = ds.manifest.shards[k]
        self.file = info.file
        self.s3 = ds._s3
        self.where = f"{self.s3.uri}/{info.file}" if self.s3 is not None else str(ds.root / info.file)
        self.fd = -1
        try:
            if self.s3 is not None:
                size = self.s3.size(info.file)
            else:
                self.fd = os.open(ds.root / info.file, os.O_RDONLY)
                size = os.fstat(self.fd).st_size
        except FileNotFoundError:
            raise FileNotFoundError(f"shard {self.where!r} is listed in the manifest but missing") from None
        try:
            if size != info.bytes:
                raise ValueError(f"shard {self.where!r} has {size} bytes, the manifest says {info.bytes}: truncated or "
                                 "replaced; `vllm-hidden inspect` checks them all")
            self._parse(info)
            if self.digests is None and ds.verify and self.s3 is None and k not in ds._checked:
                # an older output: the whole file, once per process
                from vllm_hidden.storage.files import file_checksum

                if file_checksum(ds.root / info.file) != info.blake3:
                    raise ValueError(f"shard {self.where!r} does not match its BLAKE3 checksum in the manifest: "
                                     "corrupted on disk; `vllm-hidden inspect` checks them all")
                ds._checked.add(k)
        except BaseException:
            self.close()
            raise

    def _parse(self, info: Any) -> None:
        h = ShardHeader.read(self._read, info.bytes, self.where)
        self.index: list[list[Any]] = h.index
        self.digests: list[str] | None = h.digests
        # name -> (stored dtype, shape of one row, bytes per row, file offset of row 0), in ROW_TENSORS order
        self.tensors: dict[str, tuple[torch.dtype, list[int], int, int]] = {
            name: (t.dtype, list(t.shape[1:]), t.row_bytes, t.start) for name, t in h.rows.items()}
        if len(self.index) != info.num_samples:
            raise ValueError(f"shard {self.where!r}: index has {len(self.index)} samples, the manifest says "
                             f"{info.num_samples} samples")
        self.small: dict[str, torch.Tensor] = {}
        if self.s3 is not None:  # the few-bytes-per-token tensors of the whole shard, in one GET
            names = [m for m in self.tensors if m not in _LARGE]
            rows = max((e[1] + e[2] for e in self.index), default=0)  # the rows the index reaches
            lo = min(self.tensors[m][3] for m in names)
            hi = max(self.tensors[m][3] + self.tensors[m][2] * rows for m in names)
            raw = torch.empty(hi - lo, dtype=torch.uint8)
            self._read_into(lo, as_bytes(raw))
            for m in names:  # each its own copy: a view of `raw` may start where its dtype cannot
                dtype, tail, row, off = self.tensors[m]
                self.small[m] = raw[off - lo : off - lo + row * rows].clone().view(dtype).reshape(rows, *tail)
        self.lengths: list[int] = h.lengths  # token counts, in index order

    def _read(self, offset: int, n: int) -> bytes:
        buf = bytearray(n)
        self._read_into(offset, memoryview(buf))
        return bytes(buf)

    def _read_into(self, offset: int, buf: memoryview) -> None:
        if self.s3 is not None:
            self.s3.read_into(self.file, offset, buf)
            return
        done = 0
        while done < len(buf):
            got = os.preadv(self.fd, [buf[done:]], offset + done)
            if got == 0:
                raise ValueError(f"shard {self.where!r} ended at byte {offset + done}, inside what its header lists")
            done += got

    def read(self, j: int, alloc: Alloc, verify: bool) -> tuple[list[Any], dict[str, torch.Tensor]]:
        """Sample j's index entry and its rows of each tensor, read into `alloc`'s tensors and,
        with `verify`, checked against its recorded checksum (each byte returned, once)."""
        entry = self.index[j]
        row, count = entry[1], entry[2]
        out: dict[str, torch.Tensor] = {}
        for name, (dtype, tail, row_bytes, offset) in self.tensors.items():
            t = alloc(name, dtype, (count, *tail))
            if t.dtype.itemsize != dtype.itemsize or not t.is_contiguous() or t.shape[0] != count:
                raise ValueError(f"{name}: a {t.dtype} tensor of shape {tuple(t.shape)} cannot hold {count} rows of "
                                 f"{dtype}")
            if name in self.small:
                as_bytes(t)[:] = as_bytes(self.small[name][row : row + count])
            else:
                self._read_into(offset + row * row_bytes, as_bytes(t))
            out[name] = t
        if verify and self.digests is not None:
            if sample_digest(entry, (as_bytes(t) for t in out.values())) != self.digests[j]:
                raise ValueError(f"shard {self.where!r}, sample {entry[0]!r} (its entry {j}): its bytes do not match "
                                 "the checksum recorded when it was written: corrupted; `vllm-hidden inspect` checks "
                                 "every shard")
        if "loss_mask" in out and (self.digests is None or not verify):  # unverified bytes: make them valid bools
            m = out["loss_mask"].view(torch.uint8)
            m.copy_(m != 0)
        return entry, out

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    __del__ = close  # an evicted shard may still be read by a read-ahead thread: closed when the last one is done


class HiddenStatesDataset(torch.utils.data.Dataset):
    """`ds[i]` -> {"id", "token_ids" int64 [T], "hidden_states" [T, K, H]} with K in
    `ds.layer_ids` order, plus "loss_mask" (bool [T]) and "final_hidden_states" ([T, H],
    after the model's final norm) when the output holds them, and "num_prompt_tokens" (int)
    in an `extract --generate` output. An fp8 output (`--storage-dtype fp8`) is returned
    dequantized to bf16 (value = fp8 * scale); `dequantize=False` returns the stored pairs,
    "hidden_states" float8 e4m3 [T, K, H] with "hidden_states_scale" float32 [T, K] (and
    "final_hidden_states" [T, H] with "final_hidden_states_scale" [T]). Row t of every tensor belongs
    to token t (unshifted: a trainer predicting token t+1 from row t shifts). Shards are
    opened lazily per process, so the dataset can be handed to DataLoader workers; in a worker,
    samples are read straight into shared memory.

    Reading sample i reads its rows and nothing else (plus, once per process and shard, the
    shard's header). With `verify` (the default) those bytes are checked against the checksum
    recorded for that sample when it was written, so verification costs one pass over what is
    read, however many processes read; a mismatch is a ValueError naming the shard and sample.
    A shard's size is checked against the manifest when a process opens it. An output written
    before per-sample checksums is checked as it was then: each process hashes a local shard's
    whole file when it first opens it; on S3 only sizes (`vllm-hidden inspect` hashes everything)."""

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
        self.path = path
        self.layer_ids: list[int] = list(self.manifest.layer_ids)
        self.starts: list[int] = []  # global index of each shard's first sample
        n = 0
        for s in self.manifest.shards:
            self.starts.append(n)
            n += s.num_samples
        self._len = n
        self._open: OrderedDict[int, _Shard] = OrderedDict()
        self._checked: set[int] = set()  # shards of an older output this process hashed whole
        self._lock = threading.Lock()  # read-ahead threads share the open shards
        _DATASETS.add(self)
        if verify and self.manifest.sample_checksum is None and self.manifest.shards:
            how = ("each process hashes a shard's whole file (BLAKE3) when it first opens it" if self._s3 is None else
                   "only shard sizes are checked when reading; `vllm-hidden inspect` hashes every object")
            log.warning("vllm-hidden: %s was written without per-sample checksums (an older vllm-hidden): %s",
                        path, how)

    def __len__(self) -> int:
        return self._len

    @property
    def num_shards(self) -> int:
        return len(self.manifest.shards)

    def sample_ids(self) -> list[Any]:
        """Every sample's id in dataset order, from the shard headers (no states are read)."""
        return [e[0] for k in range(self.num_shards) for e in self.shard(k).index]

    def locate(self, i: int) -> tuple[int, int]:
        """(shard, entry in that shard) of sample i."""
        if not -self._len <= i < self._len:
            raise IndexError(f"index {i} out of range for {self._len} samples")
        i %= self._len
        k = bisect.bisect_right(self.starts, i) - 1
        return k, i - self.starts[k]

    def _forked(self) -> None:
        """In a forked child (a DataLoader worker), before any of its threads runs: its own
        files, lock and S3 client; the parent's stay the parent's."""
        for s in self._open.values():
            s.fd = -1  # inherited copies, closed with the process
        self._open = OrderedDict()
        self._checked = set()
        self._lock = threading.Lock()
        if self._s3 is not None:
            self._s3._client = None  # boto3 clients are not fork-safe

    def shard(self, k: int) -> _Shard:
        with self._lock:
            s = self._open.get(k)
            if s is not None:
                self._open.move_to_end(k)
                return s
        s = _Shard(self, k)  # outside the lock: opening may read (S3) or hash (older outputs)
        with self._lock:
            s = self._open.setdefault(k, s)  # another thread may have opened it meanwhile
            self._open.move_to_end(k)
            if len(self._open) > _OPEN_SHARDS:
                self._open.popitem(last=False)
            return s

    def shard_lengths(self, k: int) -> list[int]:
        """Token counts of shard k's samples, in order (from its header)."""
        return self.shard(k).lengths

    def read(self, i: int, alloc: Alloc = new_tensor) -> dict[str, Any]:
        """Sample i with its tensors as stored (`alloc` makes the tensors its rows go into)."""
        k, j = self.locate(i)
        entry, out = self.shard(k).read(j, alloc, self.verify)
        sample: dict[str, Any] = {"id": entry[0]}
        if len(entry) > 3:  # --generate: rows [0, num_prompt_tokens) are the prompt, the rest the response
            sample["num_prompt_tokens"] = entry[3]
        sample.update(out)
        return sample

    def __getitem__(self, i: int) -> dict[str, Any]:
        return self.item(i)

    def item(self, i: int, alloc: Alloc | None = None) -> dict[str, Any]:
        """`ds[i]`, its stored tensors read into `alloc`'s (then dequantized, if so asked)."""
        out = self.read(i, alloc or new_tensor)
        if self.dequantize:
            for name, scale in SCALES.items():
                if scale in out:
                    out[name] = dequantize(out[name], out.pop(scale))
        return out

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_open"] = OrderedDict()
        state["_checked"] = set()  # checked by this process, not by the one it is sent to
        state["_lock"] = None
        s3 = state.get("_s3")
        if s3 is not None:  # a boto3 client does not cross processes: a fresh one there
            from vllm_hidden.storage.s3 import S3Location

            state["_s3"] = S3Location(s3.uri, s3.endpoint_url)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()
        _DATASETS.add(self)


_DATASETS: "weakref.WeakSet[HiddenStatesDataset]" = weakref.WeakSet()  # this process's, reset in a forked child
def _after_fork() -> None:
    for ds in list(_DATASETS):
        ds._forked()


os.register_at_fork(after_in_child=_after_fork)
