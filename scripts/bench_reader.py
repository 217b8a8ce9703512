"""Training-side read throughput of an extract output (`vllm_hidden.data`), against the
storage's sequential read ceiling and against one `torch.save` file per sample, in one run:

    python scripts/bench_reader.py --dir /data/bench-reader --tmpfs /dev/shm/bench-reader
    python scripts/bench_reader.py --dir /data/bench-reader --quick         # smoke check

Data: written once per storage location (--dir, a local disk; --tmpfs, optional) by the real
`ShardWriter`: random bf16 rows [T, K, H], layer ids 1..K, T uniform in [--tokens-min,
--tokens-max] (fixed seed), until --gb GiB of hidden states, shards of --shard-gb GiB; and the
same samples as one `torch.save({"input_ids", "hidden_states"})` file per sample (SpecForge's
layout), read by a map-style Dataset doing one `torch.load` per item.

Measured per storage (GB = 1e9 bytes):
- ceiling: every shard file read front to back with 16 MiB `os.preadv` into a reused buffer,
  by 1 thread and by N threads (N = the largest --workers) on different files; the larger;
- per --workers count, one epoch through `DataLoader(batch_size=None, prefetch_factor=2)`
  (0 workers: read in the consuming process):
  stream            ShardedStream(window, read_ahead), each sample verified (the default)
  stream-noverify   the same, HiddenStatesDataset(verify=False)
  map-shuffle       the map-style HiddenStatesDataset, shuffle=True, verified
  torchsave         one torch.load per sample file, shuffle=True
  and once each:
  before            map-style, shuffle=True, 4 workers (else the largest count), checked as outputs
                    without per-sample checksums are: each process hashes a shard's whole file
                    (BLAKE3) when it first opens it
  stream-budget     ShardedStream(token_budget=max(16384, --tokens-max), layout="packed"), at the
                    largest worker count, and in the consuming process if 0 is among --workers
  The consumer touches one byte per 4096 of every tensor it receives; payload = the tensors'
  bytes. GB/s, samples/s, ratio to the ceiling; verification overhead = 1 - stream / stream-noverify.
- on the disk (not tmpfs): every measurement starts with a cold page cache (POSIX_FADV_DONTNEED
  on every file of both datasets; checked once by re-reading a shard after dropping it), and
  the bytes the block device read during it (/proc/diskstats) are reported against the
  dataset's bytes. The main process's /proc/self/io (rchar, read_bytes; it counts the
  DataLoader workers too once they exit and are reaped) is recorded as well.

Result: one JSON (host, revision, arguments, dataset, every case, targets pass/fail) under
benchmarks/results/, and a table on stdout. The datasets are removed at the end unless --keep.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import random
import shutil
import socket
import time
import warnings
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import benchlib
import blake3
import torch

from vllm_hidden.config import ShardConfig
from vllm_hidden.data import HiddenStatesDataset, ShardedStream
from vllm_hidden.storage.manifest import Manifest
from vllm_hidden.storage.shards import ShardWriter

GB = 1e9
CHUNK = 16 << 20  # ceiling reads
TOUCH = 4096  # the consumer touches one byte per this many
VOCAB = 151_936
SHARDS, TORCHSAVE = "bench-shards", "bench-torchsave"  # the two datasets under each storage directory
BEFORE = ("the current reader with verify=False (each sample's rows read with os.preadv), plus, in each process, "
          "a whole-file BLAKE3 of a shard (read with read(), one thread) when that process opens it, compared with "
          "the manifest's blake3: the check the reader made before per-sample checksums (it hashed through mmap on "
          "all cores). Same shard files as the other cases; that reader read the rows through safetensors "
          "safe_open (mmap) get_slice, which is not reproduced")

warnings.filterwarnings("ignore", message="This DataLoader will create")  # more workers than cores: on purpose


# -- revision, storage -------------------------------------------------------------------------
def git_facts() -> dict[str, Any]:
    changes = benchlib.git_changes("vllm_hidden", "scripts")
    return {"git_revision": benchlib.git_revision(), "git_dirty": bool(changes), "git_changes": changes,
            # what ran, whatever the checkout: BLAKE3 over the package, benchlib and this script; and of this script
            "source_blake3": benchlib.source_fingerprint(__file__), "script_blake3": whole_file_blake3(Path(__file__))}


def fs_type(path: Path) -> str | None:
    """The file system type of the mount holding `path` (the longest matching mount point)."""
    best, kind = "", None
    for ln in Path("/proc/mounts").read_text().splitlines():
        _, mnt, typ, *_ = ln.split()
        mnt = mnt.replace("\\040", " ")
        if (str(path) == mnt or str(path).startswith(mnt.rstrip("/") + "/")) and len(mnt) > len(best):
            best, kind = mnt, typ
    return kind


class DiskCounter:
    """Bytes read by the block device holding a directory, from /proc/diskstats (sectors x 512)."""

    def __init__(self, path: Path) -> None:
        st = os.stat(path).st_dev
        self.dev = f"{os.major(st)}:{os.minor(st)}"
        self.name: str | None = None
        if not Path("/proc/diskstats").exists():
            self.why = "no /proc/diskstats here: bytes read from storage not recorded"
            return
        names = {f"{f[0]}:{f[1]}": f[2] for f in self._lines()}
        self.name = names.get(self.dev)
        self.why = f"block device {self.name} ({self.dev})"  # a partition's own line counts its reads
        if self.name is None:  # not listed itself: try the disk above it in sysfs, by name
            sys_dev = Path(f"/sys/dev/block/{self.dev}")
            parent = sys_dev.resolve().parent.name if sys_dev.exists() else None
            if parent in names.values():
                self.name, self.why = parent, f"{self.dev} is not in /proc/diskstats; counted on its disk {parent}"
            else:
                self.why = (f"st_dev {self.dev} of {path} is no block device listed in /proc/diskstats (overlay, "
                            "network or virtual file system?): bytes read from storage not recorded")

    @staticmethod
    def _lines() -> list[list[str]]:
        return [ln.split() for ln in Path("/proc/diskstats").read_text().splitlines()]

    def read_bytes(self) -> int | None:
        if self.name is None:
            return None
        return next(int(f[5]) * 512 for f in self._lines() if f[2] == self.name)


def cpu_seconds() -> dict[str, float]:
    """CPU time so far: this process's and its reaped children's (the DataLoader workers), and
    the whole machine's busy and stolen time (/proc/stat): what others ran beside a measurement."""
    t = os.times()
    out = {"own": t.user + t.system + t.children_user + t.children_system}
    if Path("/proc/stat").exists():
        f = [int(x) / os.sysconf("SC_CLK_TCK") for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
        out["machine_busy"] = sum(f[:8]) - f[3] - f[4] - f[7]  # user nice system irq softirq (not idle, iowait, steal)
        out["steal"] = f[7]
    return out


def proc_io() -> dict[str, int]:
    if not Path("/proc/self/io").exists():
        return {}
    fields = dict(ln.split(": ") for ln in Path("/proc/self/io").read_text().splitlines())
    return {"rchar": int(fields["rchar"]), "read_bytes": int(fields["read_bytes"])}


# -- data --------------------------------------------------------------------------------------
def plan_samples(a: argparse.Namespace) -> list[tuple[torch.Tensor, int]]:
    """(token ids, offset into the random rows) of every sample, until --gb GiB of hidden states."""
    rng = random.Random(a.seed)
    g = torch.Generator().manual_seed(a.seed)
    row_bytes = a.layers * a.hidden * 2
    out, total = [], 0
    while total < a.gb * (1 << 30):
        t = rng.randint(a.tokens_min, a.tokens_max)
        out.append((torch.randint(0, VOCAB, (t,), generator=g), rng.randrange(a.tokens_max + 1)))
        total += t * row_bytes
    return out


def random_rows(rows: int, k: int, h: int, seed: int) -> torch.Tensor:
    """[rows, k, h] random bf16 values; samples are slices of it (randn of GBs would be the slow part)."""
    g = torch.Generator().manual_seed(seed)
    out = torch.empty(rows, k, h, dtype=torch.bfloat16)
    for lo in range(0, rows, 256):
        out[lo : lo + 256] = torch.randn(out[lo : lo + 256].shape, generator=g)
    return out


def build(root: Path, a: argparse.Namespace) -> dict[str, Any]:
    """The output (the real shard writer, then the manifest) and the one-file-per-sample copy,
    the same samples for every location (fixed seed)."""
    plan = plan_samples(a)
    src = random_rows(a.tokens_max * 2 + 1, a.layers, a.hidden, a.seed)
    t0 = time.perf_counter()
    layer_ids = list(range(1, a.layers + 1))
    w = ShardWriter(ShardConfig(output_dir=str(root / SHARDS), max_shard_bytes=int(a.shard_gb * (1 << 30)),
                                writer_threads=4, final_state=False), layer_ids, a.hidden, torch.bfloat16)
    for i, (tok, off) in enumerate(plan):
        w.add(i, tok, src[off : off + len(tok)])
    shards = w.close()
    Manifest(model="bench", layer_ids=layer_ids, layer_semantics="input", num_model_layers=64, hidden_size=a.hidden,
             dtype="bfloat16", shards=shards).write(root / SHARDS)
    t1 = time.perf_counter()
    (root / TORCHSAVE).mkdir(parents=True)
    for i, (tok, off) in enumerate(plan):
        with open(root / TORCHSAVE / f"{i}.ckpt", "wb") as f:  # clone: a saved view would carry all of `src`
            torch.save({"input_ids": tok, "hidden_states": src[off : off + len(tok)].clone()}, f)
            f.flush()
            os.fsync(f.fileno())  # clean pages, so the page cache can be dropped before each measurement
    t2 = time.perf_counter()
    return {"samples": len(plan), "tokens": sum(s.num_tokens for s in shards), "shards": len(shards),
            "shard_bytes": sum(s.bytes for s in shards),
            "torchsave_bytes": sum(p.stat().st_size for p in (root / TORCHSAVE).iterdir()),
            "shard_writer_seconds": round(t1 - t0, 3), "torchsave_seconds": round(t2 - t1, 3)}


def shard_files(root: Path) -> list[Path]:
    return [root / SHARDS / s.file for s in Manifest.read(root / SHARDS).shards]


def torchsave_files(root: Path) -> list[Path]:
    return sorted((root / TORCHSAVE).iterdir(), key=lambda p: int(p.stem))


# -- page cache, ceiling -------------------------------------------------------------------------
def drop_cache(files: list[Path]) -> None:
    for p in files:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def read_files(files: list[Path]) -> int:
    """Each file front to back, 16 MiB at a time into one reused buffer; returns the bytes read."""
    buf = memoryview(bytearray(CHUNK))
    total = 0
    for p in files:
        fd = os.open(p, os.O_RDONLY)
        try:
            off = 0
            while got := os.preadv(fd, [buf], off):
                off += got
            total += off
        finally:
            os.close(fd)
    return total


def check_drop(path: Path, disk: DiskCounter) -> dict[str, Any]:
    """Whether dropping works here: a shard read twice (the second from the page cache), then
    dropped and read again; the device's reads during each re-read."""
    read_files([path])
    before = disk.read_bytes()
    read_files([path])
    warm = disk.read_bytes()
    drop_cache([path])
    read_files([path])
    cold = disk.read_bytes()
    size = path.stat().st_size
    if before is None:
        return {"file_bytes": size, "works": None, "why": disk.why}
    return {"file_bytes": size, "warm_reread_device_bytes": warm - before, "after_drop_device_bytes": cold - warm,
            "works": cold - warm >= 0.9 * size and warm - before < 0.1 * size}


def ceiling(files: list[Path], threads: int, cold: list[Path] | None) -> dict[str, Any]:
    """Sequential reads of every shard: 1 stream, then `threads` threads on different files."""
    out: dict[str, Any] = {"threads": threads}
    for key, n in (("one_stream", 1), ("parallel", threads)):
        if cold:
            drop_cache(cold)
        parts = [files[i::n] for i in range(n)]
        t0 = time.perf_counter()
        with ThreadPoolExecutor(n) as pool:  # a thread per part
            done = sum(pool.map(read_files, parts))
        dt = time.perf_counter() - t0
        out[key] = {"seconds": round(dt, 3), "bytes": done, "gb_per_s": round(done / dt / GB, 3)}
    out["gb_per_s"] = max(out["one_stream"]["gb_per_s"], out["parallel"]["gb_per_s"])
    return out


# -- readers -------------------------------------------------------------------------------------
class TorchSaveDataset(torch.utils.data.Dataset):
    """One file per sample, one `torch.load` per item (SpecForge's layout)."""

    def __init__(self, files: list[Path]) -> None:
        self.files = [str(p) for p in files]

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return torch.load(self.files[i])


def whole_file_blake3(path: Path) -> str:
    """What `file_checksum` computes, read with read() rather than mmap, so that the bytes it
    reads count in /proc/<pid>/io's rchar as every other read here does."""
    h = blake3.blake3()
    with open(path, "rb", buffering=0) as f:
        while chunk := f.read(16 << 20):
            h.update(chunk)
    return h.hexdigest()


class WholeShardVerified(HiddenStatesDataset):
    """The reader as it checked outputs without per-sample checksums: each process hashes a
    shard's whole file when it opens it; the samples are then read unverified."""

    def __init__(self, path: Path) -> None:
        super().__init__(path, verify=False)

    def shard(self, k: int) -> Any:
        if k not in self._checked:  # this process opens shard k first (the set is emptied in a forked worker)
            info = self.manifest.shards[k]
            if whole_file_blake3(self.root / info.file) != info.blake3:
                raise ValueError(f"shard {info.file!r} does not match its BLAKE3 checksum in the manifest")
            self._checked.add(k)
        return super().shard(k)


def loader(case: str, root: Path, workers: int, a: argparse.Namespace) -> torch.utils.data.DataLoader:
    kw: dict[str, Any] = {"batch_size": None, "num_workers": workers,
                          "prefetch_factor": 2 if workers else None}
    shuffled = {"shuffle": True, "generator": torch.Generator().manual_seed(a.seed)}
    stream = {"seed": a.seed, "window": a.window, "read_ahead": a.read_ahead}
    out = root / SHARDS
    if case == "stream":
        return torch.utils.data.DataLoader(ShardedStream(HiddenStatesDataset(out), **stream), **kw)
    if case == "stream-noverify":
        return torch.utils.data.DataLoader(ShardedStream(HiddenStatesDataset(out, verify=False), **stream), **kw)
    if case == "stream-budget":
        return torch.utils.data.DataLoader(ShardedStream(HiddenStatesDataset(out), token_budget=budget(a),
                                                         layout="packed", **stream), **kw)
    if case == "map-shuffle":
        return torch.utils.data.DataLoader(HiddenStatesDataset(out), **shuffled, **kw)
    if case == "before":
        return torch.utils.data.DataLoader(WholeShardVerified(out), **shuffled, **kw)
    if case == "torchsave":
        return torch.utils.data.DataLoader(TorchSaveDataset(torchsave_files(root)), **shuffled, **kw)
    raise ValueError(f"unknown case {case!r}")


def budget(a: argparse.Namespace) -> int:
    return max(16384, a.tokens_max)


def consume(dl: torch.utils.data.DataLoader) -> dict[str, Any]:
    """One epoch, as a training loop would take it: every tensor received is touched (one byte
    per 4096); returns the time (workers' start included), payload bytes and samples."""
    nbytes = samples = touched = 0
    t0 = time.perf_counter()
    for item in dl:
        for v in item.values():
            if isinstance(v, torch.Tensor):
                nbytes += v.nbytes
                touched += int(v.view(torch.uint8).reshape(-1)[::TOUCH].sum())
        samples += len(item["ids"]) if "ids" in item else 1
    return {"seconds": time.perf_counter() - t0, "payload_bytes": nbytes, "samples": samples}


# -- one storage ---------------------------------------------------------------------------------
def run_case(case: str, root: Path, workers: int, a: argparse.Namespace, ceil: float, dataset_bytes: int,
             cold: list[Path] | None, disk: DiskCounter | None) -> dict[str, Any]:
    if cold:
        drop_cache(cold)
    dl = loader(case, root, workers, a)
    dev0, io0, cpu0 = disk.read_bytes() if disk else None, proc_io(), cpu_seconds()
    r = consume(dl)
    dev1, io1, cpu1 = disk.read_bytes() if disk else None, proc_io(), cpu_seconds()
    del dl
    gbps = r["payload_bytes"] / r["seconds"] / GB
    out = {"case": case, "workers": workers, "seconds": round(r["seconds"], 3), "payload_bytes": r["payload_bytes"],
           "samples": r["samples"], "gb_per_s": round(gbps, 3), "samples_per_s": round(r["samples"] / r["seconds"], 2),
           "ratio_to_ceiling": round(gbps / ceil, 3), "dataset_bytes": dataset_bytes,
           # the main process's, with its DataLoader workers' once they are reaped (at the epoch's end)
           "process_io": {k: io1[k] - io0[k] for k in io0},
           "cpu_seconds": cpu_used(cpu0, cpu1)}
    # every byte read by this process and its workers, from the device or the page cache
    out["read_over_dataset"] = round(out["process_io"]["rchar"] / dataset_bytes, 3)
    if dev0 is not None:
        out["device_read_bytes"] = dev1 - dev0
        out["device_read_over_dataset"] = round((dev1 - dev0) / dataset_bytes, 3)
    return out


def cpu_used(c0: dict[str, float], c1: dict[str, float]) -> dict[str, float]:
    """CPU seconds during a measurement: this run's processes, the rest of the machine, stolen."""
    d = {k: round(c1[k] - c0[k], 2) for k in c0}
    if "machine_busy" in d:
        d["others"] = round(max(0.0, d.pop("machine_busy") - d["own"]), 2)
    return d


def bench_storage(name: str, root: Path, a: argparse.Namespace, info: dict[str, Any]) -> dict[str, Any]:
    """Every measurement on one storage location; the page cache is dropped before each unless it is tmpfs."""
    shards, saved = shard_files(root), torchsave_files(root)
    kind = fs_type(root.resolve())
    cached = kind not in ("tmpfs", "ramfs")
    cold = [*shards, *saved, root / SHARDS / "manifest.json"] if cached else None
    disk = DiskCounter(root) if cached else None
    res: dict[str, Any] = {"path": str(root), "fs_type": kind, "cold_page_cache": cached,
                           "device": disk.why if disk else None, "dataset": info}
    if disk:
        res["drop_cache_check"] = check_drop(shards[0], disk)
    most = max(a.workers)
    res["ceiling"] = ceiling(shards, max(1, most), cold)
    ceil = res["ceiling"]["gb_per_s"]
    print(f"{name}: ceiling {ceil:.2f} GB/s", flush=True)
    runs = [(c, w) for w in a.workers for c in ("stream", "stream-noverify", "map-shuffle", "torchsave")]
    four = 4 if 4 in a.workers else most  # the bytes-read targets are checked at 4 workers
    runs += [("before", four), ("stream-budget", most)] + ([("stream-budget", 0)] if 0 in a.workers and most else [])
    res["cases"] = []
    for case, w in runs:
        size = info["torchsave_bytes"] if case == "torchsave" else info["shard_bytes"]
        r = run_case(case, root, w, a, ceil, size, cold, disk)
        res["cases"].append(r)
        print(f"{name}: {case} x{w}: {r['gb_per_s']:.2f} GB/s, {r['samples_per_s']:.1f} samples/s"
              + (f", device read {r['device_read_over_dataset']:.2f}x" if "device_read_over_dataset" in r else ""),
              flush=True)
    gb = {(r["case"], r["workers"]): r["gb_per_s"] for r in res["cases"]}
    res["verification_overhead"] = {str(w): round(1 - gb["stream", w] / gb["stream-noverify", w], 3) for w in a.workers}
    return res


# -- targets, table ------------------------------------------------------------------------------
def targets(storages: dict[str, dict[str, Any]], workers: list[int]) -> dict[str, Any]:
    """Pass/fail: the device reads, with ShardedStream verifying at 4 workers (else the
    largest count), at most 1.1x the dataset (and what "before" read, for comparison); the
    verifying stream's GB/s at least 0.8x the ceiling, at each worker count and at its best;
    verification overhead (1 - stream / stream-noverify) at most 10% at every worker count."""
    four = 4 if 4 in workers else max(workers)
    out: dict[str, Any] = {}
    for name, s in storages.items():
        streams = {c["workers"]: c for c in s["cases"] if c["case"] == "stream"}
        t: dict[str, Any] = {}
        if s["cold_page_cache"]:
            v = streams[four].get("device_read_over_dataset")
            before = next((c.get("device_read_over_dataset") for c in s["cases"] if c["case"] == "before"), None)
            t["device_read_le_1.1x_dataset"] = {"workers": four, "value": v, "before": before,
                                                "pass": None if v is None else v <= 1.1}
        # bytes read (device or page cache): what a dataset larger than memory reads from its storage
        v = streams[four]["read_over_dataset"]
        before = next((c["read_over_dataset"] for c in s["cases"] if c["case"] == "before"), None)
        t["read_le_1.1x_dataset"] = {"workers": four, "value": v, "before": before, "pass": v <= 1.1}
        ratios = {w: c["ratio_to_ceiling"] for w, c in streams.items()}
        best = max(ratios, key=ratios.get)
        t["stream_ge_0.8x_ceiling"] = {"by_workers": {str(w): {"value": v, "pass": v >= 0.8}
                                                      for w, v in ratios.items()},
                                       "best": {"workers": best, "value": ratios[best], "pass": ratios[best] >= 0.8}}
        t["verification_overhead_le_0.10"] = {
            w: {"value": v, "pass": v <= 0.10} for w, v in s["verification_overhead"].items()}
        out[name] = t
    return out


def table(storages: dict[str, dict[str, Any]]) -> str:
    rows = [(f"{'storage':8} {'case':16} {'workers':>7} {'GB/s':>7} {'samples/s':>9} {'s':>7} {'/ceiling':>8} "
             f"{'read/data':>9} {'own cpu s':>9} {'others s':>8}")]
    for name, s in storages.items():
        c = s["ceiling"]
        rows.append(f"{name:8} {'ceiling':16} {'':>7} {c['gb_per_s']:7.2f} {'':>9} {'':>7} {'':>8} {'':>9}  "
                    f"(1 stream {c['one_stream']['gb_per_s']:.2f}, {c['threads']} threads "
                    f"{c['parallel']['gb_per_s']:.2f})")
        for r in s["cases"]:
            read, cpu = r.get("device_read_over_dataset"), r["cpu_seconds"]
            rows.append(f"{name:8} {r['case']:16} {r['workers']:>7} {r['gb_per_s']:7.2f} {r['samples_per_s']:9.1f} "
                        f"{r['seconds']:7.1f} {r['ratio_to_ceiling']:8.2f} {'' if read is None else f'{read:.2f}':>9} "
                        f"{cpu['own']:9.1f} {cpu.get('others', float('nan')):8.1f}")
        rows.append(f"{name:8} verification overhead by workers: "
                    + ", ".join(f"{w}: {v:.1%}" for w, v in s["verification_overhead"].items()))
    return "\n".join(rows)


# -- main ----------------------------------------------------------------------------------------
def remove(paths: list[Path]) -> None:
    for d in paths:
        shutil.rmtree(d, ignore_errors=True)


def parse_args() -> argparse.Namespace:
    ap = benchlib.parser(__doc__)
    ap.add_argument("--dir", required=True, type=Path, help="a directory on local disk (datasets made under it)")
    ap.add_argument("--tmpfs", type=Path, default=None, help="a directory on tmpfs, e.g. /dev/shm/bench-reader")
    ap.add_argument("--gb", type=float, default=4.0, help="GiB of hidden states")
    ap.add_argument("--hidden", type=int, default=5120)
    ap.add_argument("--layers", type=int, default=5, help="K: layer ids 1..K")
    ap.add_argument("--tokens-min", type=int, default=256)
    ap.add_argument("--tokens-max", type=int, default=4096)
    ap.add_argument("--shard-gb", type=float, default=1.0, help="GiB of tensor data per shard")
    ap.add_argument("--workers", default="0,1,2,4", help="DataLoader worker counts (0: in the consuming process)")
    ap.add_argument("--window", type=int, default=4, help="ShardedStream: shards mixed at once")
    ap.add_argument("--read-ahead", type=int, default=None,
                    help="ShardedStream: read-ahead threads per process (default: the stream's, 4 in the consuming "
                         "process and 0 in a DataLoader worker)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=None,
                    help="result JSON (default benchmarks/results/reader-<host>-<date>-<rev>.json)")
    ap.add_argument("--quick", action="store_true",
                    help="smoke run: 0.3 GiB, hidden 1024, 0.1 GiB shards, workers 1,2 (where not given otherwise)")
    ap.add_argument("--keep", action="store_true", help="keep the datasets")
    a = ap.parse_args()
    if a.quick:
        for k, v in {"gb": 0.3, "hidden": 1024, "shard_gb": 0.1, "workers": "1,2"}.items():
            if getattr(a, k) == ap.get_default(k):
                setattr(a, k, v)
    a.workers = [int(w) for w in a.workers.split(",") if w]
    if not a.workers or min(a.workers) < 0:
        ap.error("--workers: worker counts, e.g. 1,2,4")
    if not 1 <= a.tokens_min <= a.tokens_max:
        ap.error("--tokens-min must be in 1..--tokens-max")
    return a


def main() -> None:
    a = parse_args()
    benchlib.exit_on_sigterm()  # killed: still remove the datasets
    facts = git_facts()
    out = benchlib.result_path(a.out, f"reader-{socket.gethostname().split('.')[0]}-{benchlib.stamp('%Y%m%d')}-"
                                      f"{facts['git_revision'][:7]}.json")
    locations = {"disk": a.dir, **({"tmpfs": a.tmpfs} if a.tmpfs else {})}
    for root in locations.values():
        for d in (root / SHARDS, root / TORCHSAVE):
            if d.exists():
                raise SystemExit(f"{d} exists (left by an earlier run?): remove it or choose another directory")
    result: dict[str, Any] = {
        "command": benchlib.command_line(__file__), **facts, "host": benchlib.host_facts(),
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(a).items()},
        "units": "GB = 1e9 bytes; payload = bytes of the tensors delivered to the consumer",
        "before": BEFORE, "token_budget": budget(a), "storages": {}}
    t_start = time.perf_counter()
    made: dict[str, list[Path]] = {}  # to remove: a directory this run created, else the datasets in it
    try:
        for name, root in locations.items():
            made[name] = [root / SHARDS, root / TORCHSAVE] if root.exists() else [root]
            root.mkdir(parents=True, exist_ok=True)
            print(f"{name}: writing {a.gb:g} GiB under {root} ...", flush=True)
            # in a process of its own: DataLoader workers are then forked from a process that, like
            # a training process, never wrote shards (nor started BLAKE3's thread pool, which
            # does not survive fork) and holds none of the writer's memory
            with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
                info = pool.submit(build, root, a).result()
            result["storages"][name] = bench_storage(name, root, a, info)
            result["targets"] = targets(result["storages"], a.workers)
            result["wall_seconds"] = round(time.perf_counter() - t_start, 1)
            benchlib.write_json(out, result)  # after each storage: a later failure keeps the first
            if not a.keep:  # frees the tmpfs's memory, and the disk copy's page cache, before the next storage
                remove(made.pop(name))
    finally:
        if not a.keep:
            for paths in made.values():
                remove(paths)
    print(table(result["storages"]))
    print(json.dumps(result["targets"], indent=1))
    print(f"wrote {out} ({result['wall_seconds']:.0f} s)")


if __name__ == "__main__":
    main()
