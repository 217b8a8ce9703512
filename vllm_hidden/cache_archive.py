"""Warm caches as one file: `vllm-hidden warmup ... --pack FILE` writes the cache root's compile
and kernel caches (vLLM's compile cache with Inductor's inside it, Triton's kernels and stored
autotune results, the warm stamps) as a gzip-compressed tar archive, its first member a JSON
manifest naming the vLLM, torch and Triton versions and the device it was made on.
`--cache-from FILE|s3://bucket/key` on extract, serve and warmup unpacks one into the cache
root before the engine starts, so that a fresh machine starts warm, and refuses one made for
other versions or another GPU architecture (its kernels would not load, or would be rebuilt).

What is packed is the whole root as `CacheDirs` lays it out (every setting warmed into it):
warm up into a root of its own (`--cache-dir`) to pack one setting only."""

from __future__ import annotations

import builtins
import io
import json
import logging
import os
import tarfile
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from vllm_hidden.engine.caches import CACHE_DIR_NAMES, CacheDirs, versions
from vllm_hidden.errors import VllmHiddenError

log = logging.getLogger("vllm_hidden")

MANIFEST = "vllm-hidden-cache.json"  # the archive's first member
FORMAT = 1
STAMPS = "warm"  # the root's warm stamps (CacheDirs.stamp_path): packed with the caches
# what must equal this machine's for the archive's contents to be used as they are
MUST_MATCH = ("vllm", "torch", "triton")


class CacheArchiveError(VllmHiddenError, ValueError):
    """An archive that cannot be used here: not one of ours, damaged, or made for other versions
    or another device (the message names what differs)."""


@dataclass(frozen=True, kw_only=True)
class ArchiveManifest:
    format: int
    created: float
    versions: dict[str, str]  # vllm, torch, triton, vllm-hidden (engine.caches.versions)
    device: dict[str, str]  # {"name": ..., "arch": "sm_90" | "cpu:x86_64"}
    files: int = 0
    bytes: int = 0  # uncompressed
    members: list[str] = field(default_factory=list)  # the top-level folders packed

    def to_json(self) -> builtins.bytes:
        return json.dumps(asdict(self), indent=1, sort_keys=True).encode()

    @classmethod
    def from_json(cls, raw: builtins.bytes, where: str) -> "ArchiveManifest":
        try:
            d = json.loads(raw)
            m = cls(format=int(d["format"]), created=float(d["created"]), versions=dict(d["versions"]),
                    device=dict(d["device"]), files=int(d.get("files", 0)), bytes=int(d.get("bytes", 0)),
                    members=list(d.get("members", [])))
        except (ValueError, KeyError, TypeError) as e:
            raise CacheArchiveError(f"{where}: its {MANIFEST} is not a cache manifest ({e})") from None
        if m.format != FORMAT:
            raise CacheArchiveError(f"{where}: cache archive format {m.format}; this vllm-hidden reads {FORMAT}")
        return m

    def describe(self) -> str:
        v = self.versions
        return (f"vLLM {v.get('vllm')}, torch {v.get('torch')}, Triton {v.get('triton')} on "
                f"{self.device.get('arch')} ({self.device.get('name')})")


def this_machine() -> tuple[dict[str, str], dict[str, str]]:
    """(versions, device) of this machine, as a manifest records them; the device read without
    initializing CUDA in this process (engine.compat)."""
    from vllm_hidden.engine import compat

    return versions(), {"name": compat.device_name(), "arch": compat.device_arch()}


def differences(m: ArchiveManifest, here_versions: dict[str, str], here_device: dict[str, str]) -> list[str]:
    """What of the archive's versions and device differs from this machine's (empty: usable)."""
    out = [f"{name} {m.versions.get(name)} (here {here_versions.get(name)})" for name in MUST_MATCH
           if m.versions.get(name) != here_versions.get(name)]
    if m.device.get("arch") != here_device.get("arch"):
        out.append(f"device architecture {m.device.get('arch')} [{m.device.get('name')}] (here "
                   f"{here_device.get('arch')} [{here_device.get('name')}])")
    return out


def _sources(cache: CacheDirs, dirs: dict[str, str]) -> list[tuple[str, Path]]:
    """(name in the archive, directory here): the caches in use, the warm stamps."""
    out = [(CACHE_DIR_NAMES[var], Path(path)) for var, path in dirs.items()]
    return out + [(STAMPS, cache.root / STAMPS)]


def pack(cache: CacheDirs, dirs: dict[str, str], dest: str | Path) -> ArchiveManifest:
    """Write the caches `dirs` (CacheDirs.apply's) and the warm stamps to `dest` (.tar.gz), the
    manifest first; written to a temporary file beside it and renamed, so `dest` is whole or
    absent."""
    dest = Path(dest)
    if dest.is_dir():
        raise ValueError(f"--pack: {str(dest)!r} is a directory; give the archive's file name")
    if not dest.parent.is_dir():
        raise ValueError(f"--pack: the folder of {str(dest)!r} does not exist")
    here_versions, here_device = this_machine()
    files: list[tuple[str, Path]] = []
    members = []
    for name, root in _sources(cache, dirs):
        if not root.is_dir():
            continue
        members.append(name)
        for dirpath, dirnames, names in os.walk(root):
            dirnames.sort()
            for n in sorted(names):
                p = Path(dirpath) / n
                if p.is_file() and not p.is_symlink():
                    files.append((f"{name}/{p.relative_to(root).as_posix()}", p))
    if not files:
        raise ValueError(f"--pack: the caches under {cache.root} are empty; nothing to pack")
    manifest = ArchiveManifest(format=FORMAT, created=time.time(), versions=here_versions, device=here_device,
                               files=len(files), bytes=sum(p.stat().st_size for _, p in files), members=members)
    t0 = time.perf_counter()
    fd, tmp = tempfile.mkstemp(prefix=f".{dest.name}.", suffix=".tmp", dir=dest.parent)
    try:
        with os.fdopen(fd, "wb") as raw, tarfile.open(fileobj=raw, mode="w:gz", compresslevel=6) as tar:
            body = manifest.to_json()
            info = tarfile.TarInfo(MANIFEST)
            info.size, info.mtime = len(body), int(manifest.created)
            tar.addfile(info, io.BytesIO(body))
            for arcname, p in files:
                tar.add(p, arcname=arcname, recursive=False)
        os.replace(tmp, dest)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    log.info("vllm-hidden: packed %d cache files (%.1f MB) into %s (%.1f MB) in %.1f s", manifest.files,
             manifest.bytes / 1e6, dest, dest.stat().st_size / 1e6, time.perf_counter() - t0)
    return manifest


@dataclass(frozen=True, kw_only=True)
class Unpacked:
    """What `unpack` did: for the command's summary."""

    source: str
    manifest: ArchiveManifest
    files: int
    archive_bytes: int
    seconds: float

    def to_dict(self) -> dict[str, Any]:
        return {"source": self.source, "made_for": self.manifest.describe(), "files": self.files,
                "archive_bytes": self.archive_bytes, "seconds": round(self.seconds, 2)}


def _fetch(source: str, s3_endpoint_url: str | None, into: Path) -> Path:
    from vllm_hidden.storage.s3 import make_client, parse_s3_uri

    bucket, key = parse_s3_uri(source)
    if not key:
        raise ValueError(f"--cache-from: {source!r} names a bucket, not an archive's key")
    path = into / "cache.tar.gz"
    try:
        make_client(s3_endpoint_url).download_file(bucket, key, str(path))
    except Exception as e:  # noqa: BLE001 - botocore's errors: one line naming the object
        if isinstance(e, ImportError):
            raise
        raise OSError(f"--cache-from: cannot download {source}: {type(e).__name__}: {e}") from None
    return path


def unpack(source: str, cache: CacheDirs, dirs: dict[str, str], s3_endpoint_url: str | None = None) -> Unpacked:
    """Unpack the archive at `source` (a file, or s3://bucket/key) into the caches in use (`dirs`,
    CacheDirs.apply's) and the root's warm stamps, after checking its manifest against this
    machine; CacheArchiveError (a ValueError: exit 2) naming what differs, before anything is
    written. Files already there are replaced by the archive's."""
    from vllm_hidden.storage.s3 import is_s3

    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="vllm-hidden-cache-") as tmp:
        if is_s3(source):
            path = _fetch(source, s3_endpoint_url, Path(tmp))
        else:
            path = Path(source).expanduser()
            if not path.is_file():
                raise ValueError(f"--cache-from: no such file: {source!r}")
        try:
            tar = tarfile.open(path, mode="r:*")
        except (tarfile.TarError, OSError) as e:
            raise CacheArchiveError(f"--cache-from {source}: not a tar archive ({e})") from None
        with tar:
            first = tar.next()
            if first is None or first.name != MANIFEST or not first.isfile():
                raise CacheArchiveError(f"--cache-from {source}: not a vllm-hidden cache archive (its first member "
                                        f"is {first.name if first else 'missing'!r}, not {MANIFEST})")
            head = tar.extractfile(first)  # a file member (checked above): never None
            manifest = ArchiveManifest.from_json(head.read() if head else b"", f"--cache-from {source}")
            diff = differences(manifest, *this_machine())
            if diff:
                raise CacheArchiveError(f"--cache-from {source}: made for {manifest.describe()}; it differs here in "
                                        f"{'; '.join(diff)}: its compiled graphs and kernels would not be used. "
                                        "Pack one on a machine like this one (`vllm-hidden warmup ... --pack FILE`)")
            targets = {name: root for name, root in _sources(cache, dirs)}
            n = 0
            try:
                for member in tar:
                    if member is first:
                        continue
                    top, _, rest = member.name.partition("/")
                    if top not in targets or not rest:
                        raise CacheArchiveError(f"--cache-from {source}: unexpected member {member.name!r}")
                    member.name = rest
                    tar.extract(member, targets[top], filter="data")  # no links out, no absolute paths
                    n += member.isfile()
            except tarfile.FilterError as e:
                raise CacheArchiveError(f"--cache-from {source}: unsafe member refused ({e}); {n} files were "
                                        "unpacked before it") from None
            except (tarfile.TarError, EOFError, OSError) as e:
                raise CacheArchiveError(f"--cache-from {source}: damaged after {n} files ({type(e).__name__}: "
                                        f"{e}); the caches may be partly filled: a start compiles what is "
                                        "missing") from None
        size = path.stat().st_size
    done = Unpacked(source=source, manifest=manifest, files=n, archive_bytes=size, seconds=time.perf_counter() - t0)
    log.info("vllm-hidden: unpacked %d cache files from %s (made for %s) into %s in %.1f s", n, source,
             manifest.describe(), cache.root, done.seconds)
    return done


def pack_caches(cache_dir: str | None, dest: str | Path) -> "Packed":
    """`warmup --pack`: the cache root's caches, as they are in use, into `dest`."""
    cache = CacheDirs.resolve(cache_dir)
    t0 = time.perf_counter()
    manifest = pack(cache, cache.apply(), dest)
    return Packed(path=str(dest), manifest=manifest, archive_bytes=Path(dest).stat().st_size,
                  seconds=time.perf_counter() - t0)


@dataclass(frozen=True, kw_only=True)
class Packed:
    path: str
    manifest: ArchiveManifest
    archive_bytes: int
    seconds: float

    def to_dict(self) -> dict[str, Any]:
        return {"path": self.path, "made_for": self.manifest.describe(), "files": self.manifest.files,
                "bytes": self.manifest.bytes, "archive_bytes": self.archive_bytes, "seconds": round(self.seconds, 2)}


def prepare(cache_dir: str | None, cache_from: str | None, s3_endpoint_url: str | None = None) -> Unpacked | None:
    """The commands' first step: the cache root applied (before vLLM starts) and, with
    `cache_from`, an archive unpacked into it."""
    cache = CacheDirs.resolve(cache_dir)
    dirs = cache.apply()
    return unpack(cache_from, cache, dirs, s3_endpoint_url) if cache_from else None
