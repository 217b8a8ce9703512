"""Bad input lines: every kind becomes one error record (its line, its id, a reason naming the
value) and the run goes on; the good lines around them are extracted and match HF, and the
bad ones are counted before the engine starts. A file without a usable record is refused
before the engine starts, leaving nothing behind; a run that writes no sample exits 3. A
512 MiB input is streamed: the extract's memory does not grow with it."""

from __future__ import annotations

import codecs
import json
import threading
import time

import psutil
from transformers import AutoTokenizer

from tests.integration.helpers import (
    ForkedRun,
    HFReference,
    cli,
    cli_env,
    last_json,
    rel_l2,
    run_cli,
    verify_checksums,
)
from vllm_hidden.data import HiddenStatesDataset

ENGINE = ["--enforce-eager", "--dtype", "bfloat16", "--max-num-seqs", "8", "--max-num-batched-tokens", "256"]
MAX_LEN = 256


def _bad_lines():
    """(raw line, words its error reason must hold); ids are given where the line has one."""
    huge = "\u00e9t\u00e9 \u6f22\u5b57 " * 400_000  # ~5 MB of text on one line
    return [
        (b"{not json", ["invalid JSON"]),
        (b'[1, 2, 3]', ["not a JSON object", "list"]),
        (b'"just a string"', ["not a JSON object", "str"]),
        (b'\xff\xfe{"id": "binary"}', ["not UTF-8", "0xff"]),
        (json.dumps({"id": "neither", "prompt": "hi"}).encode(),
         ["unknown field 'prompt'", "expected one of token_ids, text, messages, conversations"]),
        (json.dumps({"id": "no-kind"}).encode(), ["need exactly one of", "none"]),
        (json.dumps({"id": "both", "text": "a", "token_ids": [1]}).encode(),
         ["need exactly one of", "token_ids", "text"]),
        (json.dumps({"id": "empty-ids", "token_ids": []}).encode(), ["no tokens"]),
        (json.dumps({"id": "empty-text", "text": ""}).encode(), ["no tokens"]),
        (json.dumps({"id": "empty-messages", "messages": []}).encode(), ["no tokens"]),
        (json.dumps({"id": "vocab-high", "token_ids": [1, 1024, 2]}).encode(), ["token id 1024", "vocab size 1024"]),
        (json.dumps({"id": "vocab-neg", "token_ids": [-1]}).encode(), ["token id -1"]),
        (json.dumps({"id": "float-id", "token_ids": [1, 2.5]}).encode(), ["2.5"]),
        (json.dumps({"id": "str-tok", "token_ids": ["3"]}).encode(), ["'3'"]),
        (json.dumps({"id": "bool-tok", "token_ids": [True]}).encode(), ["True"]),
        (json.dumps({"id": "ids-not-list", "token_ids": "1 2 3"}).encode(), ["list of ints", "str"]),
        (json.dumps({"id": "text-not-str", "text": 42}).encode(), ["text must be a string", "int"]),
        (json.dumps({"id": "bad-messages", "messages": [{"content": "no role"}]}).encode(), ["messages"]),
        (json.dumps({"id": "too-long", "token_ids": [5] * (MAX_LEN + 1)}).encode(),
         [f"{MAX_LEN + 1} tokens", str(MAX_LEN)]),
        (json.dumps({"id": "huge-text", "text": huge}).encode(), ["tokens, more than max_model_len"]),
        (json.dumps({"id": None, "token_ids": [1]}).encode(), ["id must be a string or an integer", "None"]),
        (json.dumps({"id": 1.5, "token_ids": [1]}).encode(), ["1.5"]),
        (json.dumps({"id": ["x"], "token_ids": [1]}).encode(), ["['x']"]),
        (json.dumps({"id": "dup", "token_ids": [9, 9]}).encode(), ["duplicate id 'dup'"]),  # 2nd of two
    ]


def _good_lines(tok):
    """(id, line object, token ids): token ids, unicode text, chat messages, edge lengths."""
    rows = [
        ("ids", {"token_ids": [3, 1, 4, 1, 5, 9, 2, 6]}),
        ("one-token", {"token_ids": [7]}),
        ("exact-max", {"token_ids": [(i * 7) % 1024 for i in range(MAX_LEN)]}),
        ("unicode", {"text": "na\u00efve caf\u00e9 \u2014 \u6f22\u5b57 \u0645\u0631\u062d\u0628\u0627 "
                             "\U0001f600 e\u0301 \u200b tab\tend"}),
        ("nul-and-escapes", {"text": "a\u0000b \\n \" quote"}),
        ("chat", {"messages": [{"role": "user", "content": "hello \u00fc"}, {"role": "assistant", "content": "hi"}]}),
        (0, {"token_ids": [11, 12, 13]}),  # integer id
        ("dup", {"token_ids": [8, 8, 8]}),  # first of two: kept
    ]
    out = []
    for sid, obj in rows:
        if "token_ids" in obj:
            ids = obj["token_ids"]
        elif "text" in obj:
            ids = tok(obj["text"])["input_ids"]
        else:
            ids = tok.apply_chat_template(obj["messages"], tokenize=True, add_generation_prompt=False)
            ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
        out.append((sid, {"id": sid, **obj}, list(ids)))
    return out


def test_every_bad_line_is_an_error_record_and_the_good_ones_match_hf(tiny_models, tmp_path, reliability_report):
    model = tiny_models("qwen3_next", 4)
    tok = AutoTokenizer.from_pretrained(str(model))
    good, bad = _good_lines(tok), _bad_lines()
    lines, want_bad = [], {}
    for k in range(max(len(good), len(bad))):  # interleaved, with blank and CRLF lines among them
        if k < len(good):
            lines.append(json.dumps(good[k][1]).encode() + (b"\r" if k % 3 == 0 else b""))
        if k < len(bad):
            want_bad[len(lines)] = bad[k][1]
            lines.append(bad[k][0])
        if k % 4 == 0:
            lines.append(b"   ")
    inp = tmp_path / "in.jsonl"
    inp.write_bytes(codecs.BOM_UTF8 + b"\n".join(lines))  # a BOM, and no newline after the last line
    out = tmp_path / "out"
    r = run_cli("extract", "--model", str(model), "--input", str(inp), "--output", str(out), "--layers", "0,3",
                "--max-model-len", str(MAX_LEN), "--no-progress", *ENGINE)
    assert r.returncode == 0, r.stderr[-3000:]
    summary = last_json(r)
    assert summary["samples"] == len(good) and summary["errors"] == len(bad), summary
    # counted before the engine started: all but the one only tokenizing finds (huge-text), the
    # first of them named (a BOM'd good line, then "{not json")
    prepass = next((x for x in r.stderr.splitlines() if "records checked" in x), r.stderr[-3000:])
    assert f"{len(bad) - 1} bad, skipped and recorded in errors.jsonl; the first: line 2 (id 1): invalid JSON" \
        in prepass, prepass

    errors = [json.loads(x) for x in (out / "errors.jsonl").read_text().splitlines()]
    by_line = {e["line"]: e for e in errors}
    assert sorted(by_line) == sorted(want_bad), (sorted(by_line), sorted(want_bad))
    for line, words in want_bad.items():
        for w in words:
            assert w in by_line[line]["reason"], (line, w, by_line[line])
    verify_checksums(out)
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["num_errors"] == len(bad)

    ds = HiddenStatesDataset(out)
    got = {ds[i]["id"]: ds[i] for i in range(len(ds))}
    assert sorted(map(str, got)) == sorted(str(g[0]) for g in good)
    ref = HFReference(model)
    worst = 0.0
    for sid, _, ids in good:
        s = got[sid]
        assert s["token_ids"].tolist() == ids, sid
        st = ref.states(ids)
        worst = max(worst, *(rel_l2(s["hidden_states"][:, k], st[layer]) for k, layer in enumerate([0, 3])))
    assert worst < 1e-2, worst
    reliability_report["bad_inputs"] = {"bad_lines": len(bad), "error_records": len(errors),
                                        "good_lines": len(good), "written": len(got),
                                        "hf_worst_rel_l2": round(worst, 5),
                                        "reasons": {str(e["id"]): e["reason"][:120] for e in errors}}


def _refused(args, output):
    """`extract` in this process: (exit code, its error line)."""
    r = cli("extract", *args, "--output", output, "--no-progress", "--layers", "1")
    return r.returncode, next((x for x in r.stderr.splitlines() if x.startswith("error: ")), r.stderr[-2000:])


def test_a_file_of_no_usable_record_is_refused_before_the_engine_leaving_nothing(tiny_models, tmp_path, s3,
                                                                                   monkeypatch, reliability_report):
    """Every line names its prompt by a field we do not read, or the file holds no record: exit
    code 2 before the engine starts, naming the line and the field; no output directory, no S3
    object. With --dp 2 the coordinator refuses it alike."""
    import vllm_hidden.extract.coordinator as co
    from vllm_hidden.extract.extractor import Extractor

    def started(*a, **k):
        raise AssertionError("an engine was started")

    monkeypatch.setattr(Extractor, "start", started)
    monkeypatch.setattr(co, "LocalRanks", started)
    url, bucket, client = s3
    model = str(tiny_models("qwen3", 4))
    wrong, blank = tmp_path / "wrong.jsonl", tmp_path / "blank.jsonl"
    wrong.write_text("".join(json.dumps({"id": i, "promt": f"question {i}"}) + "\n" for i in range(5)))
    blank.write_bytes(b"\n  \n\r\n\n")
    cases = {
        "wrong field": ([str(wrong)], ["wrong.jsonl line 1: unknown field 'promt'", "all 5 records are bad"]),
        "wrong field, --dp 2": ([str(wrong), "--dp", "2"], ["wrong.jsonl line 1: unknown field 'promt'"]),
        "blank lines only": ([str(blank)], ["blank.jsonl holds no records"]),
    }
    for what, (inp, words) in cases.items():
        for output in (str(tmp_path / "out" / "run"), f"s3://{bucket}/run"):
            code, line = _refused(["--model", model, "--input", *inp, "--s3-endpoint-url", url], output)
            assert code == 2 and all(w in line for w in words), (what, output, line)
            reliability_report.setdefault("input_refused", {})[what] = line[:240]
    assert not (tmp_path / "out").exists()
    assert client.list_objects_v2(Bucket=bucket).get("KeyCount", 0) == 0


def test_a_run_that_writes_no_sample_exits_3(tiny_models, tmp_path, reliability_report):
    """Records that pass the up-front checks but none of which fits once tokenized (each text
    longer than --max-model-len): the run ends, every record is an error record, the output is
    complete and empty, and the exit code says no sample was written."""
    model = tiny_models("qwen3", 4)
    inp, out = tmp_path / "long.jsonl", tmp_path / "out"
    inp.write_text("".join(json.dumps({"id": f"t{i}", "text": "a b c d " * 200}) + "\n" for i in range(3)))
    r = run_cli("extract", "--model", str(model), "--input", str(inp), "--output", str(out), "--layers", "1",
                "--max-model-len", str(MAX_LEN), "--no-progress", *ENGINE)
    assert r.returncode == 3, (r.returncode, r.stderr[-3000:])
    assert "error: no sample was written: all 3 records were bad" in r.stderr, r.stderr[-2000:]
    summary = last_json(r)
    assert summary["samples"] == 0 and summary["errors"] == 3
    errors = [json.loads(x) for x in (out / "errors.jsonl").read_text().splitlines()]
    assert sorted(e["id"] for e in errors) == ["t0", "t1", "t2"] and all("max_model_len" in e["reason"] for e in errors)
    assert json.loads((out / "manifest.json").read_text())["num_samples"] == 0
    assert cli("inspect", str(out)).returncode == 0  # complete, and empty
    reliability_report["no_sample_written"] = {"exit_code": r.returncode, "errors": len(errors)}


def test_the_exit_code_counts_samples_of_earlier_attempts(monkeypatch):
    """Exit 3 only when the output holds no sample: a --resume that finds every sample done wrote
    none itself and exits 0. (The CLI's reading of the run's summary, without an engine.)"""
    import vllm_hidden.extract as extract_pkg
    from vllm_hidden.extract.job import Summary

    for summary, code in ((Summary(resumed=4), 0), (Summary(samples=2, errors=1), 0), (Summary(errors=2), 3)):
        monkeypatch.setattr(extract_pkg, "run_extract", lambda cfg, s=summary: s)
        r = cli("extract", "--model", "m", "--input", "in.jsonl", "--output", "out", "--no-progress")
        assert r.returncode == code, (summary, r.returncode, r.stderr)


def _peak_rss(args):
    """Run the CLI with `args` (forked, its engine core in its process: `run_cli`); the peak
    resident memory of that process, sampled every 50 ms, and what it returned. The engine's
    own memory is there in every run alike: what differs between two runs is the input's."""
    run = ForkedRun.start(args, cli_env(inprocess=True))
    assert run is not None
    peak = [0]
    proc = psutil.Process(run.pid)
    done = threading.Event()

    def sample():
        while not done.is_set():
            try:
                peak[0] = max(peak[0], proc.memory_info().rss)
            except psutil.Error:
                return
            time.sleep(0.05)

    t = threading.Thread(target=sample, daemon=True)
    t.start()
    try:
        r = run.wait(1800)
    finally:
        done.set()
        t.join()
    return peak[0], r.returncode, r.stdout, r.stderr


def test_a_512mb_input_is_streamed_with_bounded_memory(tiny_models, tmp_path, reliability_report):
    """512 MiB of lines: every 50th a short prompt, the rest ~1 MB token lists over max_model_len
    (refused at once, as error records). The extract's peak memory must stay near that of a
    run over the short prompts alone: the file is never held, whole or in part beyond a line."""
    model = tiny_models("qwen3", 4)
    big, small = tmp_path / "big.jsonl", tmp_path / "small.jsonl"
    filler = ", ".join(str((i * 31) % 1000) for i in range(200_000))  # ~1 MB
    n_big = n_good = 0
    with open(big, "w") as fb, open(small, "w") as fs:
        while fb.tell() < (1 << 29):
            if n_big % 50 == 0:
                line = json.dumps({"id": f"g{n_good}", "token_ids": [(n_good + j) % 1000 for j in range(40)]})
                fb.write(line + "\n")
                fs.write(line + "\n")
                n_good += 1
            fb.write('{"id": "b%d", "token_ids": [%s]}\n' % (n_big, filler))
            n_big += 1
    size = big.stat().st_size
    args = ["--layers", "1", "--max-model-len", str(MAX_LEN), "--no-progress", *ENGINE]
    base = ["extract", "--model", str(model)]
    peak_small, rc, _, err = _peak_rss([*base, "--input", str(small), "--output", str(tmp_path / "o1"), *args])
    assert rc == 0, err[-3000:]
    t0 = time.monotonic()
    peak_big, rc, out, err = _peak_rss([*base, "--input", str(big), "--output", str(tmp_path / "o2"), *args])
    seconds = time.monotonic() - t0
    assert rc == 0, err[-3000:]
    big.unlink()
    summary = last_json(out)
    assert summary["samples"] == n_good and summary["errors"] == n_big, summary
    growth = peak_big - peak_small
    # a held file would be >= 512 MiB (as Python objects, several times that); one line parsed is ~10 MB
    assert growth < 200 << 20, (peak_small, peak_big)
    reliability_report["input_512mb"] = {"bytes": size, "lines": n_big + n_good, "samples": n_good,
                                       "error_records": n_big, "seconds": round(seconds, 1),
                                       "peak_rss_small_mb": peak_small >> 20, "peak_rss_512mb_mb": peak_big >> 20}
