"""Warm caches as one archive (`warmup --pack`, `--cache-from`): what is packed comes back byte
for byte under another cache root; an archive made for other versions or another device, or not
one of ours, is refused naming what differs, before anything is written; S3 sources download
from a real (moto) endpoint. (The end-to-end check, a fresh root starting warm from an archive,
is tests/integration/test_warmup.py.)"""

from __future__ import annotations

import io
import json
import tarfile

import pytest

from vllm_hidden import cache_archive
from vllm_hidden.cache_archive import MANIFEST, CacheArchiveError, pack, prepare, unpack
from vllm_hidden.engine.caches import CacheDirs


@pytest.fixture
def clean_cache_env(monkeypatch):
    for var in ("VLLM_CACHE_ROOT", "TRITON_CACHE_DIR", "TRITON_CACHE_AUTOTUNING", "VHIDDEN_CACHE_DIR"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr("vllm_hidden.engine.caches._APPLIED", {})


def _fill(root):
    files = {"vllm/torch_compile_cache/abc/rank_0_0/backbone/model.bin": b"\x00graph" * 100,
             "triton/XYZ/kernel.cubin": b"\x7fELF" + bytes(range(256)),
             "triton/XYZ/kernel.autotune.json": b'{"configs": []}',
             "warm/0123.json": b'{"kind": "warmup"}'}
    for rel, data in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(data)
    (root / "locks").mkdir()
    (root / "locks" / "x.lock").write_text("")  # not a cache: never packed
    return files


def test_what_is_packed_comes_back_under_another_root(tmp_path, clean_cache_env):
    src = CacheDirs.resolve(str(tmp_path / "a"))
    files = _fill(src.root)
    archive = tmp_path / "warm.tar.gz"
    m = pack(src, src.apply(), archive)
    assert m.files == len(files) and m.bytes == sum(map(len, files.values()))
    with tarfile.open(archive) as tar:  # plain tarfile reads it; the manifest comes first
        names = tar.getnames()
        assert names[0] == MANIFEST and sorted(names[1:]) == sorted(files)
        head = json.loads(tar.extractfile(names[0]).read())
    assert set(head["versions"]) >= {"vllm", "torch", "triton"} and head["device"]["arch"].startswith("cpu:")

    dst = CacheDirs.resolve(str(tmp_path / "b"))
    done = unpack(str(archive), dst, dst.apply())
    assert done.files == len(files)
    for rel, data in files.items():
        assert (dst.root / rel).read_bytes() == data, rel
    assert not (dst.root / "locks").exists()


def test_an_archive_for_other_versions_or_another_gpu_is_refused_naming_what_differs(tmp_path, clean_cache_env,
                                                                                    monkeypatch):
    src = CacheDirs.resolve(str(tmp_path / "a"))
    _fill(src.root)
    versions, device = cache_archive.this_machine()
    archive = tmp_path / "other.tar.gz"
    monkeypatch.setattr(cache_archive, "this_machine",
                        lambda: ({**versions, "vllm": "0.26.0"}, {"name": "NVIDIA H200", "arch": "sm_90"}))
    pack(src, src.apply(), archive)
    monkeypatch.undo()
    dst = CacheDirs.resolve(str(tmp_path / "b"))
    with pytest.raises(CacheArchiveError) as e:
        prepare(str(dst.root), str(archive))
    msg = str(e.value)
    assert f"vllm 0.26.0 (here {versions['vllm']})" in msg
    assert f"device architecture sm_90 [NVIDIA H200] (here {device['arch']}" in msg
    assert "torch" not in msg.split("differs here in")[1].split(";")[0]  # only what differs is named
    assert not (dst.root / "vllm" / "torch_compile_cache").exists()  # nothing written


def test_not_an_archive_of_ours(tmp_path, clean_cache_env):
    dst = CacheDirs.resolve(str(tmp_path / "b"))
    dirs = dst.apply()
    junk = tmp_path / "junk.tar.gz"
    junk.write_bytes(b"not a tar")
    with pytest.raises(CacheArchiveError, match="not a tar archive"):
        unpack(str(junk), dst, dirs)
    other = tmp_path / "other.tar.gz"
    with tarfile.open(other, "w:gz") as tar:
        info = tarfile.TarInfo("README")
        info.size = 2
        tar.addfile(info, io.BytesIO(b"hi"))
    with pytest.raises(CacheArchiveError, match="first member is 'README', not vllm-hidden-cache.json"):
        unpack(str(other), dst, dirs)
    with pytest.raises(ValueError, match="no such file"):
        unpack(str(tmp_path / "missing.tar.gz"), dst, dirs)
    with pytest.raises(ValueError, match="is a directory"):
        pack(dst, dirs, tmp_path)


def test_a_member_outside_the_caches_is_refused(tmp_path, clean_cache_env):
    src = CacheDirs.resolve(str(tmp_path / "a"))
    _fill(src.root)
    archive = tmp_path / "warm.tar.gz"
    pack(src, src.apply(), archive)
    evil = tmp_path / "evil.tar.gz"
    with tarfile.open(archive) as a, tarfile.open(evil, "w:gz") as b:
        for m in a.getmembers():
            b.addfile(m, a.extractfile(m))
        info = tarfile.TarInfo("vllm/../../escaped")
        info.size = 1
        b.addfile(info, io.BytesIO(b"x"))
    dst = CacheDirs.resolve(str(tmp_path / "b"))
    with pytest.raises(CacheArchiveError, match="unsafe member refused"):
        unpack(str(evil), dst, dst.apply())
    assert not (tmp_path / "escaped").exists() and not (tmp_path / "b" / "escaped").exists()


def test_an_archive_on_s3(tmp_path, clean_cache_env, s3):
    url, bucket, client = s3
    src = CacheDirs.resolve(str(tmp_path / "a"))
    files = _fill(src.root)
    archive = tmp_path / "warm.tar.gz"
    pack(src, src.apply(), archive)
    client.upload_file(str(archive), bucket, "h100/warm.tar.gz")
    dst = CacheDirs.resolve(str(tmp_path / "b"))
    done = unpack(f"s3://{bucket}/h100/warm.tar.gz", dst, dst.apply(), s3_endpoint_url=url)
    assert done.files == len(files) and done.archive_bytes == archive.stat().st_size
    assert (dst.root / "triton/XYZ/kernel.cubin").read_bytes() == files["triton/XYZ/kernel.cubin"]
    with pytest.raises(OSError, match=f"cannot download s3://{bucket}/nope.tar.gz"):
        unpack(f"s3://{bucket}/nope.tar.gz", dst, dst.apply(), s3_endpoint_url=url)
