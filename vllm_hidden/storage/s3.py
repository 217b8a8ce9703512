"""S3 output: shards uploaded as they close (boto3's transfer manager: multipart, concurrent
parts, retries with backoff), the local staging copy evicted once S3 confirms it, the
manifest uploaded last. Credentials and endpoint come from boto3's usual chain (env, config
files, instance roles; `AWS_ENDPOINT_URL`), or `--s3-endpoint-url`.

On S3 a shard object exists only once its upload completed (multipart uploads are atomic),
and carries its BLAKE3 and counts as object metadata: the objects under the prefix are the
durable record a resumed run starts from. Its per-layer statistics do not fit in object
metadata (2 KB): a resume reads them from the shard's header, with its index.
"""

from __future__ import annotations

import json
import logging
import re
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path
from typing import Any

from vllm_hidden.config import DEFAULT_S3_RETRY_S
from vllm_hidden.format.shard import ShardHeader, ShardInfo, shard_number

log = logging.getLogger("vllm_hidden")

_URI = re.compile(r"^s3://([a-z0-9][a-z0-9.\-]{1,61}[a-z0-9])(?:/(.*))?$")


def is_s3(path: str | Path) -> bool:
    return str(path).startswith("s3://")


def parse_s3_uri(uri: str) -> tuple[str, str]:
    """'s3://bucket/a/b/' -> ('bucket', 'a/b'); the prefix has no trailing slash."""
    m = _URI.match(uri)
    if not m:
        raise ValueError(f"not an s3://bucket/prefix URI: {uri!r}")
    return m.group(1), (m.group(2) or "").strip("/")


def make_client(endpoint_url: str | None = None):
    try:
        import boto3
        from botocore.config import Config
    except ImportError:
        raise ImportError("S3 needs boto3: pip install boto3 (in a clone of vllm-hidden: "
                          "pip install -e '.[s3]')") from None
    # standard retry mode: exponential backoff with jitter on throttling, 5xx and dropped connections
    cfg = Config(retries={"max_attempts": 8, "mode": "standard"}, connect_timeout=10, read_timeout=120,
                 max_pool_connections=32)
    return boto3.client("s3", endpoint_url=endpoint_url or None, config=cfg)


class S3Location:
    """A bucket + prefix and the few operations the run needs on it."""

    def __init__(self, uri: str, endpoint_url: str | None = None, retry_for_s: float = DEFAULT_S3_RETRY_S) -> None:
        self.uri = uri.rstrip("/")
        self.retry_for_s = retry_for_s  # how long put_json/put_file ride out a passing outage
        self.bucket, self.prefix = parse_s3_uri(uri)
        self.endpoint_url = endpoint_url
        self._client = None

    @property
    def client(self):
        if self._client is None:
            self._client = make_client(self.endpoint_url)
        return self._client

    def key(self, name: str) -> str:
        return f"{self.prefix}/{name}" if self.prefix else name

    def names(self) -> list[str]:
        """Object names directly under the prefix."""
        out, token = [], None
        base = self.key("")
        while True:
            kw = {"Bucket": self.bucket, "Prefix": base}
            if token:
                kw["ContinuationToken"] = token
            r = self.client.list_objects_v2(**kw)
            out += [o["Key"][len(base):] for o in r.get("Contents", []) if "/" not in o["Key"][len(base):]]
            if not r.get("IsTruncated"):
                return out
            token = r["NextContinuationToken"]

    def subdirs(self) -> list[str]:
        """Names of the "directories" directly under the prefix."""
        out, token = [], None
        base = self.key("")
        while True:
            kw = {"Bucket": self.bucket, "Prefix": base, "Delimiter": "/"}
            if token:
                kw["ContinuationToken"] = token
            r = self.client.list_objects_v2(**kw)
            out += [p["Prefix"][len(base):].rstrip("/") for p in r.get("CommonPrefixes", [])]
            if not r.get("IsTruncated"):
                return out
            token = r["NextContinuationToken"]

    def sub(self, name: str) -> "S3Location":
        """The location `name` under this prefix (this one for "")."""
        if not name:
            return self
        loc = S3Location(f"{self.uri}/{name}", self.endpoint_url, self.retry_for_s)
        loc._client = self._client
        return loc

    def get_json(self, name: str) -> Any:
        return json.loads(self.client.get_object(Bucket=self.bucket, Key=self.key(name))["Body"].read())

    # run.json, errors.jsonl and the manifest ride out a passing outage as shards do: a blip
    # at the end of a run must not fail it after every shard is up
    def put_json(self, name: str, obj: Any) -> None:
        body = json.dumps(obj, indent=1).encode()
        ride_out(lambda: self.client.put_object(Bucket=self.bucket, Key=self.key(name), Body=body,
                                                ContentType="application/json"), f"upload of {name}", self.uri,
                 self.retry_for_s)

    def put_file(self, local: Path, name: str) -> None:
        ride_out(lambda: self.client.upload_file(str(local), self.bucket, self.key(name)), f"upload of {name}",
                 self.uri, self.retry_for_s)

    def read_range(self, name: str, start: int, end: int) -> bytes:
        """Bytes [start, end) of an object."""
        r = self.client.get_object(Bucket=self.bucket, Key=self.key(name), Range=f"bytes={start}-{end - 1}")
        return r["Body"].read()

    def read_into(self, name: str, start: int, buf: memoryview) -> None:
        """Bytes [start, start + len(buf)) of an object into `buf`, in one ranged GET. boto3
        retries the request; a body cut off mid-read (or a passing outage) is tried again
        within `retry_for_s`, as uploads are."""
        end = start + len(buf)

        def get() -> None:
            r = self.client.get_object(Bucket=self.bucket, Key=self.key(name), Range=f"bytes={start}-{end - 1}")
            data = r["Body"].read()
            if len(data) != len(buf):
                raise OSError(f"{self.uri}/{name}: bytes {start}..{end} came back as {len(data)} bytes")
            buf[:] = data

        ride_out(get, f"read of {name}", self.uri, self.retry_for_s)

    def size(self, name: str) -> int:
        """An object's size in bytes (FileNotFoundError if there is none)."""
        from botocore.exceptions import ClientError

        try:
            return int(self.client.head_object(Bucket=self.bucket, Key=self.key(name))["ContentLength"])
        except ClientError as e:
            if e.response.get("Error", {}).get("Code") in ("404", "NoSuchKey", "NotFound"):
                raise FileNotFoundError(f"{self.uri}/{name}") from None
            raise

    def shard_header(self, info: ShardInfo) -> ShardHeader:
        """A shard object's parsed header, in two ranged GETs."""
        return ShardHeader.read(lambda offset, n: self.read_range(info.file, offset, offset + n), info.bytes,
                                f"{self.uri}/{info.file}")

    def abort_stale_uploads(self) -> int:
        """Multipart uploads a killed run left open under the prefix (invisible, but billed)."""
        n = 0
        pages = self.client.get_paginator("list_multipart_uploads").paginate(Bucket=self.bucket, Prefix=self.key(""))
        for page in pages:
            for u in page.get("Uploads", []):
                self.client.abort_multipart_upload(Bucket=self.bucket, Key=u["Key"], UploadId=u["UploadId"])
                n += 1
        return n

    def shard_infos(self, prefix: str = "shard") -> list[ShardInfo]:
        """The shards that completed their upload, from their object metadata."""
        infos = []
        for name in sorted(n for n in self.names() if shard_number(n, prefix) is not None):
            h = self.client.head_object(Bucket=self.bucket, Key=self.key(name))
            meta = h.get("Metadata", {})
            if "blake3" not in meta:
                raise ValueError(f"{self.uri}/{name} has no blake3 metadata: not written by vllm-hidden")
            infos.append(ShardInfo(file=name, bytes=int(h["ContentLength"]), blake3=meta["blake3"],
                                   num_samples=int(meta["num-samples"]), num_tokens=int(meta["num-tokens"])))
        return infos


_THROTTLING = frozenset({"Throttling", "ThrottlingException", "SlowDown", "RequestTimeout", "RequestTimeTooSkewed",
                         "RequestLimitExceeded", "TooManyRequestsException", "ProvisionedThroughputExceededException"})


def ride_out(fn: Callable[[], Any], what: str, where: str, retry_for_s: float = DEFAULT_S3_RETRY_S) -> Any:
    """`fn()`, tried again with backoff from 1 s to 30 s for `retry_for_s` seconds while it
    fails for a reason that passes (`transient`); any other failure is raised at once."""
    deadline, wait = time.monotonic() + retry_for_s, 1.0
    while True:
        try:
            return fn()
        except Exception as e:  # noqa: BLE001 - tried again if transient, else raised
            if not transient(e) or time.monotonic() + wait > deadline:
                raise
            log.warning("vllm-hidden: %s to %s failed (%r); trying again in %.0f s", what, where, e, wait)
            time.sleep(wait)
            wait = min(2 * wait, 30.0)


def transient(e: BaseException | None) -> bool:
    """Whether a failed S3 call may succeed when tried again: a connection that failed or
    dropped, a 5xx, throttling (anywhere in the exception's chain: the transfer manager
    wraps the client's error)."""
    from botocore.exceptions import ClientError, ConnectionError, HTTPClientError

    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, (ConnectionError, HTTPClientError)):
            return True
        if isinstance(e, ClientError):
            status = e.response.get("ResponseMetadata", {}).get("HTTPStatusCode") or 0
            return status >= 500 or status == 429 or e.response.get("Error", {}).get("Code") in _THROTTLING
        e = e.__cause__ or e.__context__
    return False


class S3Uploader:
    """Uploads closed shards in the background. `submit` blocks while `max_pending` uploads
    are queued or running (backpressure all the way to the engine); a confirmed upload
    (size checked with a HEAD) evicts the staged file; the first failure is kept and raised,
    naming the shard, on the next submit or at close.

    boto3 retries each request, but its budget is spent in seconds when many fail at once
    (a storm of 503s, an endpoint restart: its exponential backoff starts at a fraction of a
    second, and its client-wide retry quota runs dry), so a shard whose upload failed for a
    transient reason is uploaded again, with backoff up to 30 s, for `retry_for_s` seconds."""

    def __init__(self, loc: S3Location, max_pending: int = 4, part_concurrency: int = 8,
                 on_uploaded: Callable[[ShardInfo], None] | None = None,
                 retry_for_s: float = DEFAULT_S3_RETRY_S) -> None:
        from boto3.s3.transfer import TransferConfig

        self.loc = loc
        self.retry_for_s = retry_for_s
        self.transfer = TransferConfig(multipart_threshold=64 << 20, multipart_chunksize=64 << 20,
                                       max_concurrency=part_concurrency, use_threads=True)
        self._slots = threading.BoundedSemaphore(max_pending)
        self._pool = ThreadPoolExecutor(max_pending, thread_name_prefix="vllm-hidden-s3")
        self._futures: list[Future] = []
        self._error: BaseException | None = None
        self._lock = threading.Lock()
        self.uploaded: list[ShardInfo] = []
        self.on_uploaded = on_uploaded
        self.bytes = 0
        self.busy_s = 0.0

    def _raise(self) -> None:
        if self._error is not None:
            raise OSError(f"uploading to {self.loc.uri} failed: {self._error}") from self._error

    def submit(self, local: Path, info: ShardInfo) -> None:
        self._raise()
        self._slots.acquire()
        try:
            self._futures.append(self._pool.submit(self._upload, local, info))
        except BaseException:
            self._slots.release()
            raise

    def _put(self, local: Path, info: ShardInfo) -> None:
        key = self.loc.key(info.file)
        meta = {"blake3": info.blake3, "num-samples": str(info.num_samples), "num-tokens": str(info.num_tokens)}
        self.loc.client.upload_file(str(local), self.loc.bucket, key, ExtraArgs={"Metadata": meta},
                                    Config=self.transfer)
        size = self.loc.client.head_object(Bucket=self.loc.bucket, Key=key)["ContentLength"]
        if size != info.bytes:
            raise OSError(f"{info.file}: S3 holds {size} bytes, the shard has {info.bytes}")

    def _upload(self, local: Path, info: ShardInfo) -> None:
        t0 = time.perf_counter()
        try:
            ride_out(lambda: self._put(local, info), f"upload of {info.file}", self.loc.uri, self.retry_for_s)
            local.unlink()  # confirmed on S3: evict the staged copy
            with self._lock:
                self.uploaded.append(info)
                self.bytes += info.bytes
            if self.on_uploaded is not None:
                self.on_uploaded(info)
        except BaseException as e:  # noqa: BLE001 - kept, raised on the producer side
            log.error("vllm-hidden: upload of %s to %s failed: %r", info.file, self.loc.uri, e)
            with self._lock:
                if self._error is None:
                    self._error = OSError(f"shard {info.file} was not uploaded: {e!r}")
        finally:
            with self._lock:
                self.busy_s += time.perf_counter() - t0
            self._slots.release()

    def close(self) -> list[ShardInfo]:
        for f in list(self._futures):
            f.exception()
        self._pool.shutdown(wait=True)
        self._raise()
        return sorted(self.uploaded, key=lambda s: s.file)


def read_uploaded(loc: S3Location, shards: list[ShardInfo]) -> tuple[list[ShardInfo], set[Any]]:
    """The uploaded shards with their statistics, and the sample ids they hold: from their
    safetensors headers (ranged GETs)."""
    done: set[Any] = set()
    out = []
    for s in shards:
        header = loc.shard_header(s)
        for entry in header.index:
            if entry[0] in done:
                raise ValueError(f"sample id {entry[0]!r} is in two shards under {loc.uri}; the output is damaged")
            done.add(entry[0])
        out.append(s if s.stats is not None or header.stats is None else replace(s, stats=header.stats))
    return out, done


def read_done_ids(loc: S3Location, shards: list[ShardInfo]) -> set[Any]:
    """Sample ids in the uploaded shards (their safetensors headers, ranged GETs)."""
    return read_uploaded(loc, shards)[1]
