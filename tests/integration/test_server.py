"""The OpenAI server with hidden states: real `vllm-hidden serve` processes on 127.0.0.1, the
official `openai` client, states checked against HF Transformers on the same weights. The
main server runs two API server processes (`--api-server-count 2`), so every test here also
checks that a response's states come back to the process holding its request, and that a
fetch reaching the other process gets them."""

from __future__ import annotations

import json
import threading
import time

import pytest
import torch

from tests.integration.helpers import HFReference, Server, check_states
from tests.integration.helpers import token_prompt as prompt

LAYERS = [0, 2, 3]  # of a 4-layer model; 3 is the last (taken before the final norm)
KEY = "test-key-1"
MAX_HIDDEN = 400
MAX_BODY = 200_000
FETCH_TTL = 30  # s; the expiry test (last) waits out what is left of it after the others
UNFETCHED = 2 << 20  # bytes over both API processes
EXPIRING: dict = {}  # an unfetched fetch-form object and when it was answered, for the expiry test


@pytest.fixture(scope="module")
def dense(tiny_models):
    return tiny_models("qwen3", 4)


# The servers run eager (a compile each would cost the CI machine ~30 s or more): the capture
# path under torch.compile is checked against HF by test_extract.py (prefill) and
# test_generate.py (decode, the hybrid), and a compiled server starts in test_warmup.py.
@pytest.fixture(scope="module")
def fetch_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("fetch")


@pytest.fixture(scope="module")
def servers(dense, tiny_models, tmp_path_factory, fetch_dir):
    """The module's three servers, started together (each fixture below waits for its own):
    ours, a plain vLLM one, and the hybrid started the `vllm serve` way."""
    hybrid = tiny_models("qwen3_next", 4)
    started: dict = {"hybrid_model": hybrid}
    try:
        started["server"] = Server(
            dense, tmp_path_factory.mktemp("srv") / "server.log", ",".join(map(str, LAYERS)), "--max-model-len",
            "1024", "--enforce-eager", "--enable-prompt-tokens-details", "--max-hidden-tokens", str(MAX_HIDDEN),
            "--max-request-bytes", str(MAX_BODY), "--api-server-count", "2", "--fetch-ttl", str(FETCH_TTL),
            "--max-unfetched-bytes", str(UNFETCHED), "--fetch-dir", str(fetch_dir), api_key=KEY, wait=False)
        started["plain"] = Server(dense, tmp_path_factory.mktemp("plain") / "server.log", None,  # as `server`
                                  "--max-model-len", "1024", "--enforce-eager", "--enable-prompt-tokens-details",
                                  api_key=KEY, wait=False)
        # vLLM's flags alone, no `vllm-hidden serve`: the capture config in --additional-config and
        # the middleware by --middleware
        started["hybrid"] = Server(hybrid, tmp_path_factory.mktemp("hybrid") / "server.log", None,
                                   "--max-model-len", "1024", "--enforce-eager", "--additional-config",
                                   json.dumps({"vllm_hidden": {"layer_ids": [0, 1, 3]}}),
                                   "--middleware", "vllm_hidden.server.HiddenStatesMiddleware", wait=False)
        yield started
    finally:
        for name in ("server", "plain", "hybrid"):
            if name in started:
                started[name].stop()


@pytest.fixture(scope="module")
def server(servers):
    return servers["server"].ready()


def _unfetched_bytes(fetch_dir) -> int:
    return sum(f.stat().st_size for f in fetch_dir.glob("vllm-hidden-fetch-*/*"))


@pytest.fixture(scope="module")
def ref(dense):
    return HFReference(dense)


def test_completion_prompt_states_match_hf(server, ref):
    c = server.client()
    p = prompt(1, 40)
    r = c.completions.create(model=server.model_name(), prompt=p, max_tokens=4, temperature=0,
                             extra_body={"hidden_states": True})
    obj = r.model_extra["hidden_states"]
    assert obj["format"] == "safetensors" and obj["encoding"] == "base64" and obj["tokens"] == "prompt"
    assert obj["not_finite"] == {"count": 0, "tokens": 0, "first_token": None, "layer_ids": []}
    check_states(ref, obj, LAYERS, ids=p)
    assert r.choices[0].text  # the completion itself is still there


def test_fetch_form_equals_inline_and_hf(server, ref):
    """Both forms of the same requests (completions, chat, streaming): the same states, equal
    to HF; the fetch form's bytes come by one GET, with the client helper or by hand."""
    import requests

    from vllm_hidden.server import decode, fetch

    c = server.client()
    model = server.model_name()
    p = prompt(40, 45)
    got = {}
    for transfer in ("inline", "fetch"):
        r = c.completions.create(model=model, prompt=p, max_tokens=5, temperature=0,
                                 extra_body={"hidden_states": {"tokens": "all", "transfer": transfer}})
        obj = r.model_extra["hidden_states"]
        got[transfer] = (decode(obj) if transfer == "inline" else fetch(c, obj), obj)
    inline, fetched = got["inline"][0], got["fetch"][0]
    obj = got["fetch"][1]
    assert "data" not in obj and obj["url"].startswith("/v1/hidden_states/") and obj["expires_in"] == FETCH_TTL
    assert {k: v for k, v in obj.items() if k not in ("url", "bytes", "expires_in", "transfer")} == \
        {k: v for k, v in got["inline"][1].items() if k not in ("data", "encoding", "transfer")}
    assert fetched["token_ids"].tolist() == inline["token_ids"].tolist()
    assert torch.equal(fetched["hidden_states"], inline["hidden_states"])
    check_states(ref, got["inline"][1], LAYERS, ids=inline["token_ids"].tolist())

    # chat, streaming: the fetch object arrives with the last event; fetched by a plain GET
    for stream in (False, True):
        kw = dict(model=model, messages=[{"role": "user", "content": "abc de fgh ij"}], max_tokens=4, temperature=0,
                  extra_body={"hidden_states": {"layers": [3, 0], "transfer": "fetch"}})
        if stream:
            obj = [ch for ch in c.chat.completions.create(stream=True, **kw)][-1].model_extra["hidden_states"]
        else:
            obj = c.chat.completions.create(**kw).model_extra["hidden_states"]
        r = requests.get(server.url + obj["url"], headers={"Authorization": f"Bearer {KEY}"}, timeout=60)
        assert r.status_code == 200 and r.headers["content-type"] == "application/octet-stream"
        assert len(r.content) == obj["bytes"]
        from safetensors.torch import load

        d = load(r.content)
        assert list(d["hidden_states"].shape) == obj["shape"]
        check_states(ref, obj, [3, 0], fetched=d)
        # once only
        again = requests.get(server.url + obj["url"], headers={"Authorization": f"Bearer {KEY}"}, timeout=60)
        assert again.status_code == 404 and "already fetched" in again.text

    # left unfetched, for the expiry test at the end of this module
    r = c.completions.create(model=model, prompt=prompt(41, 12), max_tokens=1,
                             extra_body={"hidden_states": {"transfer": "fetch"}})
    EXPIRING.update(obj=r.model_extra["hidden_states"], at=time.monotonic())


def test_fetch_needs_the_api_key_and_a_known_id(server, ref):
    import requests

    from vllm_hidden.server import fetch

    c = server.client()
    p = prompt(42, 20)
    obj = c.completions.create(model=server.model_name(), prompt=p, max_tokens=2,
                               extra_body={"hidden_states": {"transfer": "fetch"}}).model_extra["hidden_states"]
    for auth in (None, "Bearer wrong"):
        r = requests.get(server.url + obj["url"], headers={"Authorization": auth} if auth else {}, timeout=60)
        assert r.status_code == 401, (auth, r.status_code, r.text)
    with pytest.raises(RuntimeError, match="HTTP 401"):
        fetch(server.url, obj, api_key="wrong")
    d = fetch(server.url + "/v1", obj, api_key=KEY)  # a 401 does not use the fetch up
    assert d["token_ids"].tolist() == p
    with pytest.raises(RuntimeError, match="HTTP 404"):
        fetch(c, obj)
    for bad in ("A" * 32, "x", "..%2F..%2Fetc%2Fpasswd", obj["url"].rsplit("/", 1)[1] + "A"):
        r = requests.get(server.url + "/v1/hidden_states/" + bad, headers={"Authorization": f"Bearer {KEY}"},
                         timeout=60)
        assert r.status_code == 404 and r.json()["error"]["code"] == 404, (bad, r.text)


def test_unfetched_states_are_bounded(server, fetch_dir):
    """Fetch-form responses nobody fetches: past --max-unfetched-bytes the next one is a 503
    naming the limit (before the engine runs it), the directory never holds more, and
    fetching frees the room."""
    from vllm_hidden.server import fetch

    c = server.client()
    model = server.model_name()
    held, refused = [], 0
    for i in range(400):
        code, body = server.post("/v1/completions", {"model": model, "prompt": prompt(2000 + i, MAX_HIDDEN),
                                                     "max_tokens": 1, "hidden_states": {"transfer": "fetch"}})
        if code == 503:
            assert "--max-unfetched-bytes" in body["error"]["message"], body
            refused += 1
            if refused >= 6:  # 6 in a row: full (each connection reaches either API process)
                break
            continue
        assert code == 200, body
        refused = 0
        held.append(body["hidden_states"])
        assert _unfetched_bytes(fetch_dir) <= UNFETCHED
    size = held[0]["bytes"]
    # at least one API process's half of the budget is full, and nothing is over it
    assert refused >= 6 and UNFETCHED // 2 - size <= len(held) * size <= UNFETCHED, (len(held), size)
    for obj in held:
        assert fetch(c, obj)["hidden_states"].shape[0] == MAX_HIDDEN
    assert _unfetched_bytes(fetch_dir) <= EXPIRING["obj"]["bytes"]
    code, body = server.post("/v1/completions", {"model": model, "prompt": prompt(3000, MAX_HIDDEN), "max_tokens": 1,
                                                 "hidden_states": {"transfer": "fetch"}})
    assert code == 200 and fetch(c, body["hidden_states"])["token_ids"].tolist() == prompt(3000, MAX_HIDDEN)


def test_completion_all_tokens_cover_generated_tokens(server, ref):
    c = server.client()
    p = prompt(2, 30)
    r = c.completions.create(model=server.model_name(), prompt=p, max_tokens=8, temperature=0,
                             extra_body={"hidden_states": {"layers": [3, 0], "tokens": "all"},
                                         "return_token_ids": True})
    gen = list(r.choices[0].token_ids)
    assert len(gen) == r.usage.completion_tokens == 8
    # the last sampled token is never run through the model, so it has no state
    check_states(ref, r.model_extra["hidden_states"], [3, 0], ids=p + gen[:-1])


def test_chat_streaming_states_arrive_with_the_final_chunk(server, ref):
    c = server.client()
    stream = c.chat.completions.create(
        model=server.model_name(), messages=[{"role": "user", "content": "abc de fgh ij"}], max_tokens=5,
        temperature=0, stream=True, stream_options={"include_usage": True},
        extra_body={"hidden_states": {"layers": [2], "tokens": "all"}})
    chunks = list(stream)
    assert [ch for ch in chunks[:-1] if "hidden_states" in (ch.model_extra or {})] == []
    last = chunks[-1]
    obj = last.model_extra["hidden_states"]
    assert obj["num_tokens"] == last.usage.prompt_tokens + last.usage.completion_tokens - 1
    check_states(ref, obj, [2])
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text


def test_chat_prompt_states_non_streaming(server, ref):
    c = server.client()
    r = c.chat.completions.create(model=server.model_name(),
                                  messages=[{"role": "system", "content": "x y"},
                                            {"role": "user", "content": "hello there"}],
                                  max_tokens=3, temperature=0, extra_body={"hidden_states": {"layers": [0, 3]}})
    obj = r.model_extra["hidden_states"]
    assert obj["num_tokens"] == r.usage.prompt_tokens
    check_states(ref, obj, [0, 3])


def test_prefix_cache_stays_on_and_a_states_request_gets_every_row(server, ref):
    c = server.client()
    shared = prompt(3, 300)
    a, b = shared + prompt(4, 20), shared + prompt(5, 25)
    model = server.model_name()
    c.completions.create(model=model, prompt=a, max_tokens=1, temperature=0)  # fills the cache
    warm = c.completions.create(model=model, prompt=b, max_tokens=1, temperature=0)
    assert warm.usage.prompt_tokens_details.cached_tokens > 0  # plain requests use the cache
    r = c.completions.create(model=model, prompt=b, max_tokens=1, temperature=0, extra_body={"hidden_states": True})
    assert not (r.usage.prompt_tokens_details and r.usage.prompt_tokens_details.cached_tokens)
    check_states(ref, r.model_extra["hidden_states"], LAYERS, ids=b)


@pytest.fixture(scope="module")
def plain(servers):
    return servers["plain"].ready()


def _without_ids(obj):
    # ids and times differ per request; system_fingerprint hashes the engine config, which
    # has the capture entry on our server
    if isinstance(obj, dict):
        return {k: _without_ids(v) for k, v in obj.items() if k not in ("id", "created", "system_fingerprint")}
    if isinstance(obj, list):
        return [_without_ids(v) for v in obj]
    return obj


def _sse(text: str) -> list:
    return [json.loads(line[6:]) if line != "data: [DONE]" else "[DONE]"
            for line in text.split("\n\n") if line.startswith("data: ")]


def _merged(chunks: list) -> dict:
    """A stream's content whatever its chunking: how many tokens one chunk carries depends on
    when the API server sends it (timing), not on the server. Per choice: its text, the lists
    in its logprobs joined, its role and finish reason; the usage; the stream's end."""
    out: dict = {"done": chunks[-1:] == ["[DONE]"], "choices": {}, "usage": None}
    for c in chunks:
        if c == "[DONE]":
            continue
        out["usage"] = c.get("usage") or out["usage"]
        for ch in c["choices"]:
            m = out["choices"].setdefault(ch["index"], {"text": "", "logprobs": {}, "role": None, "finish": None})
            delta = ch.get("delta") or {}
            m["text"] += ch.get("text") or delta.get("content") or ""
            m["role"] = delta.get("role") or m["role"]
            m["finish"] = ch.get("finish_reason") or m["finish"]
            for k, v in (ch.get("logprobs") or {}).items():
                m["logprobs"].setdefault(k, []).extend(v if isinstance(v, list) else [v])
    return out


def test_requests_without_the_field_match_a_plain_server(server, plain):
    import requests

    model_ours, model_plain = server.model_name(), plain.model_name()
    assert model_ours == model_plain
    cases = [
        ("/v1/completions", {"prompt": prompt(6, 25), "max_tokens": 6, "temperature": 0, "logprobs": 2}),
        ("/v1/completions", {"prompt": "abc de fgh", "max_tokens": 4, "temperature": 0, "echo": True}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi there"}], "max_tokens": 5,
                                  "temperature": 0}),
        # a reserved key smuggled in vllm_xargs is removed, not acted on
        ("/v1/completions", {"prompt": prompt(7, 12), "max_tokens": 3, "temperature": 0,
                             "vllm_xargs": {"vllm_hidden_serve": json.dumps({"id": "x", "rows": 10**9})}}),
    ]
    for path, payload in cases:
        got = [s.post(path, {"model": model_ours, **payload}) for s in (server, plain)]
        assert got[0][0] == got[1][0] == 200, got
        assert "hidden_states" not in got[0][1]
        assert _without_ids(got[0][1]) == _without_ids(got[1][1]), path
    for path, payload in cases[:1] + cases[2:3]:
        streams = []
        for s in (server, plain):
            r = requests.post(s.url + path, json={"model": model_ours, **payload, "stream": True},
                              headers={"Authorization": f"Bearer {KEY}"}, timeout=120)
            assert r.status_code == 200
            streams.append(_merged(_without_ids(_sse(r.text))))
        assert streams[0] == streams[1] and streams[0]["done"], streams
        assert streams[0]["choices"][0]["text"] and streams[0]["choices"][0]["finish"], streams


def test_bad_requests_get_4xx_and_the_server_keeps_serving(server, ref):
    model = server.model_name()
    base = {"model": model, "prompt": prompt(8, 20), "max_tokens": 2}
    bad = [
        ({"hidden_states": {"layers": [1]}}, 400, "allowed layer ids: [0, 2, 3]"),
        ({"hidden_states": {"layers": [0, 0]}}, 400, "duplicate"),
        ({"hidden_states": {"layers": "0"}}, 400, "non-empty list"),
        ({"hidden_states": "yes"}, 400, "must be true or an object"),
        ({"hidden_states": {"layer": [0]}}, 400, "unknown keys"),
        ({"hidden_states": {"tokens": "generated"}}, 400, "'hidden_states.tokens'"),
        ({"hidden_states": True, "n": 2}, 400, "n=1"),
        ({"hidden_states": True, "prompt": [prompt(9, 5), prompt(10, 5)]}, 400, "single prompt"),
        ({"hidden_states": True, "prompt": prompt(11, MAX_HIDDEN + 1)}, 400, f"limit of {MAX_HIDDEN}"),
        ({"hidden_states": {"tokens": "all"}, "prompt": prompt(12, 300), "max_tokens": 200}, 400, "lower max_tokens"),
    ]
    for extra, status, text in bad:
        code, body = server.post("/v1/completions", {**base, **extra})
        assert code == status, (extra, code, body)
        assert text in json.dumps(body), (extra, body)
    # streaming: the limit is checked before the first event, so it is a 400 too
    code, body = server.post("/v1/completions", {**base, "prompt": prompt(13, MAX_HIDDEN + 5), "stream": True,
                                                 "hidden_states": True})
    assert code == 400 and "limit" in json.dumps(body)
    # vLLM's --api-key check comes first, for requests with the field too
    for auth in (None, "Bearer wrong"):
        code, body = server.post("/v1/completions", {**base, "hidden_states": {"layers": [7]}},
                                 headers={"Authorization": auth})
        assert code == 401, (auth, code, body)
    code, body = server.post("/v1/completions",
                             json.dumps({**base, "hidden_states": True, "pad": "x" * MAX_BODY}).encode())
    assert code == 413 and str(MAX_BODY) in json.dumps(body)
    # the field after the limit: found while the body streams on to vLLM, still a 413
    code, body = server.post("/v1/completions",
                             json.dumps({**base, "pad": "x" * 8 * MAX_BODY, "hidden_states": True}).encode())
    assert code == 413 and str(MAX_BODY) in json.dumps(body)
    # a large body without the field is vLLM's to answer, as on a plain server
    code, body = server.post("/v1/completions",
                             json.dumps({**base, "temperature": 0, "pad": "x" * 8 * MAX_BODY}).encode())
    assert code == 200 and "hidden_states" not in body and body["choices"][0]["text"]
    code, body = server.post("/v1/completions", b'{"hidden_states": true, "prompt": [1, 2')  # malformed JSON
    assert 400 <= code < 500
    # still serving, with states
    code, body = server.post("/v1/completions", {**base, "hidden_states": True})
    assert code == 200
    check_states(ref, body["hidden_states"], LAYERS, ids=base["prompt"])


def test_concurrent_mixed_load(server, ref):
    """32 clients x 3 requests, with and without states, inline and fetch, streaming and not,
    over two API server processes: every response complete and carrying its own request's
    states; the server's memory does not grow with the load."""
    from vllm_hidden.server import fetch

    model = server.model_name()
    c = server.client(timeout=300)
    errors: list = []
    results: list = []

    def client(i: int) -> None:
        try:
            for j in range(3):
                p = prompt(1000 + 3 * i + j, 10 + (7 * i + j) % 50)
                want = (i + j) % 2 == 0
                transfer = "fetch" if i % 3 == 1 else "inline"
                extra = {"hidden_states": {"layers": LAYERS, "tokens": "all" if j == 1 else "prompt",
                                           "transfer": transfer}} if want else {}
                if i % 4 == 3:
                    chunks = list(c.completions.create(model=model, prompt=p, max_tokens=4, temperature=0, stream=True,
                                                       extra_body=extra))
                    obj = (chunks[-1].model_extra or {}).get("hidden_states")
                    text = "".join(ch.choices[0].text for ch in chunks if ch.choices)
                else:
                    r = c.completions.create(model=model, prompt=p, max_tokens=4, temperature=0, extra_body=extra)
                    obj, text = r.model_extra.get("hidden_states"), r.choices[0].text
                fetched = fetch(c, obj) if obj is not None and transfer == "fetch" else None
                results.append((p, want, j == 1, obj, text, fetched))
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(repr(e))

    def round_() -> None:
        threads = [threading.Thread(target=client, args=(i,)) for i in range(32)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()

    round_()  # warm: allocator pools, compiled paths
    rss0 = server.rss_bytes()
    results.clear()
    round_()
    rss1 = server.rss_bytes()
    assert errors == []
    assert len(results) == 96
    for p, want, all_tokens, obj, text, fetched in results:
        assert text
        if not want:
            assert obj is None
            continue
        d = check_states(ref, obj, LAYERS, fetched=fetched)
        ids = d["token_ids"].tolist()
        assert ids[: len(p)] == p and len(ids) == (len(p) + 3 if all_tokens else len(p))
    assert rss1 - rss0 < 256 << 20, (rss0, rss1)
    # both API server processes served states (each logs it when it first does)
    log = server.log.read_text()
    assert "API server process 0 of 2" in log and "API server process 1 of 2" in log


@pytest.fixture(scope="module")
def hybrid(servers):
    return servers["hybrid"].ready(), servers["hybrid_model"]


def test_gated_deltanet_hybrid_prompt_and_generated_states(hybrid):
    server, model = hybrid
    ref = HFReference(model)
    c = server.client()
    name = server.model_name()
    for seed, n in ((20, 37), (21, 300)):  # 300: more than one prefill chunk of the GDN kernels
        p = prompt(seed, n)
        r = c.completions.create(model=name, prompt=p, max_tokens=6, temperature=0,
                                 extra_body={"hidden_states": {"tokens": "all"}, "return_token_ids": True})
        check_states(ref, r.model_extra["hidden_states"], [0, 1, 3], ids=p + list(r.choices[0].token_ids)[:-1])
        r = c.completions.create(model=name, prompt=p, max_tokens=2, temperature=0, extra_body={"hidden_states": True})
        check_states(ref, r.model_extra["hidden_states"], [0, 1, 3], ids=p)


def test_client_disconnect_mid_stream_leaves_the_server_serving(server, ref):
    import requests

    model = server.model_name()
    for _ in range(3):
        r = requests.post(server.url + "/v1/completions", stream=True, timeout=120,
                          headers={"Authorization": f"Bearer {KEY}"},
                          json={"model": model, "prompt": prompt(30, 20), "max_tokens": 200, "temperature": 0,
                                "ignore_eos": True, "stream": True, "hidden_states": {"tokens": "all"}})
        assert r.status_code == 200
        next(r.iter_lines())  # the first event, then hang up
        r.close()
    p = prompt(31, 15)
    code, body = server.post("/v1/completions", {"model": model, "prompt": p, "max_tokens": 3, "hidden_states": True})
    assert code == 200
    check_states(ref, body["hidden_states"], LAYERS, ids=p)


def test_unfetched_states_expire(server, fetch_dir):
    """The fetch-form object left unfetched by the first fetch test: a 404 once its TTL is
    over, and its file deleted."""
    import requests

    obj = EXPIRING["obj"]
    time.sleep(max(0.0, EXPIRING["at"] + FETCH_TTL + 1 - time.monotonic()))
    r = requests.get(server.url + obj["url"], headers={"Authorization": f"Bearer {KEY}"}, timeout=60)
    assert r.status_code == 404 and "expired" in r.text
    entry = obj["url"].rsplit("/", 1)[1]
    deadline = time.monotonic() + 30
    while list(fetch_dir.glob(f"vllm-hidden-fetch-*/{entry}")) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not list(fetch_dir.glob(f"vllm-hidden-fetch-*/{entry}"))
