"""Pure tests of the server's request field / response object and the middleware's helpers
(no vLLM engine, no server)."""

import asyncio
import base64
import dataclasses
import json
from types import SimpleNamespace

import pytest
import torch

from vllm_hidden.server.asgi import splice_parts as _splice_parts
from vllm_hidden.server.middleware import _check_shape, _strip_reserved
from vllm_hidden.server.protocol import HiddenStatesSpec, RequestError, decode, encode, parse_field, returned_token_ids
from vllm_hidden.server.registry import Pending
from vllm_hidden.server.stream import StreamSplicer as _StreamSplicer


def _splice(obj_json: bytes, key: bytes, value: bytes) -> bytes:
    return b"".join(bytes(p) for p in _splice_parts(obj_json, key, [value]))


SERVER = (4, 8, 12, 20)  # the server's captured layers, in server order


# -- parse_field ------------------------------------------------------------------------

def test_true_means_all_server_layers_in_server_order_prompt_tokens():
    spec = parse_field(True, SERVER)
    assert spec.layer_ids == (4, 8, 12, 20)
    assert spec.columns == (0, 1, 2, 3)
    assert spec.tokens == "prompt" and not spec.all_tokens


@pytest.mark.parametrize("value", [None, False])
def test_none_and_false_mean_not_asked(value):
    assert parse_field(value, SERVER) is None


def test_layer_subset_in_another_order_maps_to_server_columns():
    spec = parse_field({"layers": [20, 4, 12]}, SERVER)
    assert spec.layer_ids == (20, 4, 12)
    assert spec.columns == (3, 0, 2)
    assert spec.tokens == "prompt"


def test_tokens_all_without_layers_takes_every_layer():
    spec = parse_field({"tokens": "all"}, SERVER)
    assert spec.all_tokens and spec.tokens == "all"
    assert spec.layer_ids == SERVER and spec.columns == (0, 1, 2, 3)


def test_tokens_all_with_layers():
    spec = parse_field({"layers": [12], "tokens": "all"}, SERVER)
    assert spec.all_tokens and spec.layer_ids == (12,) and spec.columns == (2,)


def test_explicit_prompt_mode():
    spec = parse_field({"layers": [8], "tokens": "prompt"}, SERVER)
    assert not spec.all_tokens and spec.columns == (1,)


@pytest.mark.parametrize(
    "value, needles",
    [
        # unknown layer id: names it and lists the allowed ids
        ({"layers": [4, 7]}, ["[7]", "[4, 8, 12, 20]"]),
        ({"layers": [99]}, ["99", "[4, 8, 12, 20]"]),
        # duplicates
        ({"layers": [8, 4, 8]}, ["duplicate", "[8, 4, 8]"]),
        # empty list
        ({"layers": []}, ["[]", "[4, 8, 12, 20]"]),
        # non-int ids
        ({"layers": [4, "8"]}, ["[4, '8']"]),
        ({"layers": [4.0]}, ["[4.0]"]),
        # bool ids (bool is an int subclass)
        ({"layers": [True]}, ["[True]"]),
        ({"layers": [4, False]}, ["[4, False]"]),
        # layers not a list
        ({"layers": 8}, ["got 8"]),
        ({"layers": "4,8"}, ["'4,8'"]),
        ({"layers": {"a": 4}}, ["{'a': 4}"]),
        # unknown keys
        ({"layers": [4], "dtype": "float16"}, ["dtype"]),
        ({"layer": [4]}, ["'layer'"]),
        # bad tokens mode
        ({"tokens": "generated"}, ["'generated'", "prompt", "all"]),
        ({"tokens": True}, ["True"]),
        # a bare string / number / list instead of true or an object
        ("yes", ["'yes'"]),
        ("true", ["'true'"]),
        (1, ["got 1"]),
        ([4, 8], ["[4, 8]"]),
    ],
)
def test_bad_shapes_are_400_with_a_message_naming_the_problem(value, needles):
    with pytest.raises(RequestError) as ei:
        parse_field(value, SERVER)
    err = ei.value
    assert err.status == 400
    msg = str(err)
    for n in needles:
        assert n in msg, (n, msg)
    body = err.body()["error"]
    assert body["code"] == 400 and body["type"] == "BadRequestError" and body["message"] == msg


def test_request_error_is_a_value_error_and_500_body():
    e = RequestError("boom", status=500, param=None)
    assert isinstance(e, ValueError)
    assert e.body() == {"error": {"message": "boom", "type": "InternalServerError", "param": None, "code": 500}}


# -- returned_token_ids -----------------------------------------------------------------

def test_returned_token_ids_prompt_mode_is_the_prompt():
    spec = parse_field(True, SERVER)
    assert returned_token_ids(spec, [5, 6, 7], [100, 101, 102]) == [5, 6, 7]


def test_returned_token_ids_all_mode_drops_the_last_generated():
    spec = parse_field({"tokens": "all"}, SERVER)
    assert returned_token_ids(spec, [5, 6, 7], [100, 101, 102]) == [5, 6, 7, 100, 101]
    assert returned_token_ids(spec, [5, 6, 7], [100]) == [5, 6, 7]
    assert returned_token_ids(spec, [5, 6, 7], []) == [5, 6, 7]


def test_returned_token_ids_does_not_alias_the_inputs():
    spec = parse_field(True, SERVER)
    prompt = [1, 2]
    out = returned_token_ids(spec, prompt, [])
    out.append(3)
    assert prompt == [1, 2]


# -- encode / decode --------------------------------------------------------------------

def _rows(r, k, h):
    # distinct, exactly representable in bfloat16 (integers < 256)
    return torch.arange(r * k * h, dtype=torch.float32).reshape(r, k, h).to(torch.bfloat16)


def test_encode_decode_round_trip_with_permuted_columns_and_extra_rows():
    R, K, H, T = 6, 4, 3, 4  # two rows past the end, as a worker may send
    rows = _rows(R, K, H)
    assert len(set(rows.float().flatten().tolist())) == R * K * H
    spec = parse_field({"layers": [12, 4, 20]}, SERVER)
    token_ids = [11, 22, 33, 44]

    raw = encode(spec, rows, token_ids)
    assert isinstance(raw, bytes)
    obj = json.loads(raw)
    assert obj["format"] == "safetensors"
    assert obj["encoding"] == "base64"
    assert obj["layer_ids"] == [12, 4, 20]
    assert obj["num_tokens"] == T
    assert obj["tokens"] == "prompt"
    assert obj["dtype"] == "bfloat16"
    assert obj["shape"] == [T, 3, H]
    base64.b64decode(obj["data"], validate=True)

    out = decode(obj)
    hs = out["hidden_states"]
    assert hs.dtype == torch.bfloat16
    assert hs.shape == (T, 3, H)
    expected = rows[:T][:, [2, 0, 3]]
    assert torch.equal(hs, expected)
    # spot-check one value by hand: token 1, requested layer 20 (server column 3), feature 2
    assert hs[1, 2, 2].item() == float(1 * K * H + 3 * H + 2)
    assert out["token_ids"].dtype == torch.int64
    assert out["token_ids"].tolist() == token_ids


def test_encode_decode_round_trip_all_layers_identity_columns():
    R, K, H = 3, 4, 2
    rows = _rows(R, K, H)
    spec = parse_field({"tokens": "all"}, SERVER)
    obj = json.loads(encode(spec, rows, [7, 8, 9]))
    assert obj["layer_ids"] == list(SERVER) and obj["num_tokens"] == 3 and obj["tokens"] == "all"
    out = decode(obj)
    assert torch.equal(out["hidden_states"], rows)
    assert out["token_ids"].tolist() == [7, 8, 9]


def test_encode_single_layer():
    rows = _rows(2, 4, 5)
    spec = parse_field({"layers": [8]}, SERVER)
    out = decode(json.loads(encode(spec, rows, [1, 2])))
    assert torch.equal(out["hidden_states"], rows[:, 1:2])


def test_encode_too_few_rows_is_a_500():
    rows = _rows(2, 4, 3)
    spec = parse_field(True, SERVER)
    with pytest.raises(RequestError) as ei:
        encode(spec, rows, [1, 2, 3])
    assert ei.value.status == 500
    assert "2" in str(ei.value) and "3" in str(ei.value)


@pytest.mark.parametrize("obj", [{"format": "npy", "encoding": "base64", "data": ""},
                                 {"format": "safetensors", "encoding": "hex", "data": ""}, {}])
def test_decode_rejects_other_formats(obj):
    with pytest.raises(ValueError):
        decode(obj)


# -- middleware helpers -----------------------------------------------------------------

def test_splice_into_empty_object():
    out = _splice(b"{}", b"hidden_states", b'{"x":1}')
    assert json.loads(out) == {"hidden_states": {"x": 1}}


def test_splice_into_empty_object_with_whitespace():
    out = _splice(b"{ \n }\n", b"k", b"[1,2]")
    assert json.loads(out) == {"k": [1, 2]}


def test_splice_into_non_empty_object_keeps_every_key():
    original = {"id": "cmpl-1", "choices": [{"text": "hi}", "index": 0}], "usage": {"prompt_tokens": 3}, "e": {}}
    raw = json.dumps(original).encode() + b"\n"
    out = _splice(raw, b"hidden_states", b'{"x":1}')
    parsed = json.loads(out)
    assert parsed == {**original, "hidden_states": {"x": 1}}


def test_splice_compact_object():
    out = _splice(b'{"a":1,"b":{"c":[]}}', b"hs", b"null")
    assert json.loads(out) == {"a": 1, "b": {"c": []}, "hs": None}


@pytest.mark.parametrize("raw", [b"[1, 2]", b'"str"', b""])
def test_splice_rejects_non_objects(raw):
    with pytest.raises(ValueError):
        _splice(raw, b"k", b"1")


def test_strip_reserved_removes_only_our_prefix():
    req = {"prompt": "hi", "vllm_xargs": {"vllm_hidden_request": "forged", "vllm_hidden_serve": {"id": 1},
                                          "vllm_hiddenX": 1, "foo": 2, "vllm_other": 3, "my_vllm_hidden": 4}}
    assert _strip_reserved(req) is True
    assert req == {"prompt": "hi", "vllm_xargs": {"foo": 2, "vllm_other": 3, "my_vllm_hidden": 4}}


def test_strip_reserved_reports_nothing_removed():
    req = {"vllm_xargs": {"foo": 1, "bar": "vllm_hidden_request"}}
    assert _strip_reserved(req) is False
    assert req == {"vllm_xargs": {"foo": 1, "bar": "vllm_hidden_request"}}


@pytest.mark.parametrize("req", [{}, {"prompt": "x"}, {"vllm_xargs": None}, {"vllm_xargs": ["vllm_hidden_request"]}])
def test_strip_reserved_without_an_xargs_dict(req):
    before = json.dumps(req)
    assert _strip_reserved(req) is False
    assert json.dumps(req) == before


COMPL, CHAT = "/v1/completions", "/v1/chat/completions"


@pytest.mark.parametrize(
    "req, path, param",
    [
        ({"prompt": "a", "n": 2}, COMPL, "n"),
        ({"messages": [], "n": 2}, CHAT, "n"),
        ({"prompt": "a", "n": 0}, COMPL, "n"),
        ({"prompt": "a", "use_beam_search": True}, COMPL, "use_beam_search"),
        ({"messages": [], "use_beam_search": True}, CHAT, "use_beam_search"),
        ({"prompt": ["a", "b"]}, COMPL, "prompt"),
        ({"prompt": [[1, 2], [3]]}, COMPL, "prompt"),
    ],
)
def test_check_shape_rejects(req, path, param):
    with pytest.raises(RequestError) as ei:
        _check_shape(req, path)
    assert ei.value.status == 400 and ei.value.param == param


@pytest.mark.parametrize(
    "req, path",
    [
        ({"prompt": [1, 2, 3]}, COMPL),  # one prompt given as token ids
        ({"prompt": "hello"}, COMPL),
        ({"prompt": ["hello"]}, COMPL),
        ({"prompt": [[1, 2, 3]]}, COMPL),
        ({"prompt": "a", "n": 1, "use_beam_search": False}, COMPL),
        ({"messages": [{"role": "user", "content": "x"}]}, CHAT),
    ],
)
def test_check_shape_accepts(req, path):
    _check_shape(req, path)


def test_check_shape_n2_message_names_n():
    with pytest.raises(RequestError, match="n=2"):
        _check_shape({"prompt": "a", "n": 2}, COMPL)


# -- _StreamSplicer ---------------------------------------------------------------------

class FakeMiddleware:
    def __init__(self):
        self.calls = 0

    async def stream_value(self, pending):
        self.calls += 1
        return [b'{"x":', b'1}']  # JSON byte pieces, as the middleware's method returns


def _events():
    return [
        {"id": "c1", "object": "chat.completion.chunk", "choices": [{"index": 0, "delta": {"role": "assistant"}}]},
        {"id": "c1", "object": "chat.completion.chunk", "choices": [{"index": 0, "delta": {"content": "Hel"}}]},
        {"id": "c1", "object": "chat.completion.chunk", "choices": [{"index": 0, "delta": {"content": "lo\n\n"}}]},
        {"id": "c1", "object": "chat.completion.chunk",
         "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}], "usage": {"completion_tokens": 3}},
    ]


def _sse(events):
    return b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in events) + b"data: [DONE]\n\n"


def _run_splicer(messages, pending, mw):
    sent = []

    async def send(msg):
        sent.append(msg)

    async def go():
        sp = _StreamSplicer(send, pending, mw)
        for m in messages:
            await sp(m)

    asyncio.run(go())
    return sent


START_200 = {"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]}


def _body(b, more=True):
    return {"type": "http.response.body", "body": b, "more_body": more}


def _split(stream, cuts):
    cuts = sorted(set(c for c in cuts if 0 < c < len(stream)))
    pieces, prev = [], 0
    for c in cuts + [len(stream)]:
        pieces.append(stream[prev:c])
        prev = c
    return pieces


def _cut_points(stream):
    first = stream.index(b"\n\n")
    second = stream.index(b"\n\n", first + 2)
    done = stream.index(b"data: [DONE]")
    return {
        "one_piece": [],
        "mid_first_event": [10],
        "between_the_two_newlines": [first + 1, second + 1],
        "just_before_done": [done, done + 3],
        "inside_done_terminator": [len(stream) - 1],
        "every_7_bytes": list(range(7, len(stream), 7)),
        "every_byte": list(range(1, len(stream))),
    }


@pytest.mark.parametrize("case", ["one_piece", "mid_first_event", "between_the_two_newlines", "just_before_done",
                                  "inside_done_terminator", "every_7_bytes", "every_byte"])
@pytest.mark.parametrize("final_empty", [True, False])
def test_stream_splicer_adds_states_to_last_event_before_done(case, final_empty):
    events = _events()
    stream = _sse(events)
    pieces = _split(stream, _cut_points(stream)[case])
    if final_empty:
        msgs = [START_200] + [_body(p) for p in pieces] + [_body(b"", more=False)]
    else:
        msgs = [START_200] + [_body(p) for p in pieces[:-1]] + [_body(pieces[-1], more=False)]
    mw = FakeMiddleware()
    sent = _run_splicer(msgs, SimpleNamespace(rejected=None), mw)

    assert sent[0]["type"] == "http.response.start" and sent[0]["status"] == 200
    bodies = sent[1:]
    assert all(m["type"] == "http.response.body" for m in bodies)
    assert all(m["more_body"] for m in bodies[:-1]) and bodies[-1]["more_body"] is False
    out = b"".join(m["body"] for m in bodies)
    assert out.endswith(b"\n\n")
    chunks = out.split(b"\n\n")
    assert chunks[-1] == b""
    chunks = chunks[:-1]
    assert chunks[-1] == b"data: [DONE]"
    assert all(c.startswith(b"data: ") for c in chunks)
    got = [json.loads(c[len(b"data: "):]) for c in chunks[:-1]]
    assert len(got) == len(events)
    for e, g in zip(events[:-1], got[:-1]):
        assert g == e  # untouched, in order
    assert got[-1] == {**events[-1], "hidden_states": {"x": 1}}
    assert mw.calls == 1


def test_stream_splicer_done_in_the_final_message_with_the_last_event():
    events = _events()
    stream = _sse(events)
    last = stream.rindex(b"data: {")
    msgs = [START_200, _body(stream[:last]), _body(stream[last:], more=False)]
    sent = _run_splicer(msgs, SimpleNamespace(rejected=None), FakeMiddleware())
    out = b"".join(m["body"] for m in sent[1:])
    chunks = out.split(b"\n\n")[:-1]
    assert chunks[-1] == b"data: [DONE]"
    assert json.loads(chunks[-2][6:]) == {**events[-1], "hidden_states": {"x": 1}}
    assert [json.loads(c[6:]) for c in chunks[:-2]] == events[:-1]


def test_stream_splicer_rejected_request_gets_a_400_and_no_events():
    events = _events()
    stream = _sse(events)
    msg = "max_tokens=5000 needs more rows than this server returns (4096)"
    mw = FakeMiddleware()
    pieces = _split(stream, [30, 100])
    msgs = [START_200] + [_body(p) for p in pieces] + [_body(b"", more=False)]
    pending = Pending(token="t", spec=parse_field(True, (0,)), max_tokens=1, future=None, rejected=msg)
    sent = _run_splicer(msgs, pending, mw)

    starts = [m for m in sent if m["type"] == "http.response.start"]
    assert len(starts) == 1 and starts[0]["status"] == 400
    body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    assert b"data:" not in body and b"[DONE]" not in body
    err = json.loads(body)["error"]
    assert err["message"] == msg
    assert err["code"] == 400
    assert mw.calls == 0
    # the response is complete
    assert sent[-1]["type"] == "http.response.body" and sent[-1]["more_body"] is False


def test_stream_splicer_passes_a_non_200_response_through_unchanged():
    start = {"type": "http.response.start", "status": 422,
             "headers": [(b"content-type", b"application/json"), (b"content-length", b"40")]}
    err_body = b'{"error": {"message": "bad", "code": 422}}\n\n{"x": 1}'
    msgs = [start, _body(err_body[:15]), _body(err_body[15:], more=False)]
    mw = FakeMiddleware()
    sent = _run_splicer(msgs, SimpleNamespace(rejected=None), mw)
    assert sent[0] == start
    assert [m["body"] for m in sent[1:]] == [err_body[:15], err_body[15:]]
    assert sent[-1]["more_body"] is False
    assert mw.calls == 0


def test_stream_splicer_does_not_add_states_to_an_error_event():
    error_event = {"error": {"message": "engine died", "code": 500}}
    stream = _sse([_events()[1], error_event])
    mw = FakeMiddleware()
    sent = _run_splicer([START_200, _body(stream, more=False)], SimpleNamespace(rejected=None), mw)
    out = b"".join(m["body"] for m in sent[1:])
    assert out == stream
    assert mw.calls == 0


def test_stream_splicer_states_error_becomes_an_error_object_in_the_event():
    class FailingMiddleware:
        async def stream_value(self, pending):
            raise RequestError("hidden states did not arrive", status=500)

    events = _events()
    sent = _run_splicer([START_200, _body(_sse(events), more=False)], SimpleNamespace(rejected=None),
                        FailingMiddleware())
    chunks = b"".join(m["body"] for m in sent[1:]).split(b"\n\n")[:-1]
    assert chunks[-1] == b"data: [DONE]"
    last = json.loads(chunks[-2][6:])
    assert last["hidden_states"]["error"]["message"] == "hidden states did not arrive"
    assert last["hidden_states"]["error"]["code"] == 500
    assert {k: v for k, v in last.items() if k != "hidden_states"} == events[-1]


def test_spec_is_frozen():
    spec = HiddenStatesSpec(layer_ids=(4,), columns=(0,))
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.tokens = "all"


def test_serve_config_from_env_and_bad_values_name_flag_and_variable():
    from vllm_hidden.config import ServeConfig

    cfg = ServeConfig.from_env({"VHIDDEN_MAX_HIDDEN_TOKENS": "77", "VHIDDEN_HIDDEN_STATES_TIMEOUT": "2.5",
                                "OTHER": "x"})
    assert (cfg.max_hidden_tokens, cfg.timeout_s, cfg.max_concurrent) == (77, 2.5, ServeConfig().max_concurrent)
    assert ServeConfig.from_env(cfg.to_env()) == cfg
    # the names before they matched their flags still work; the new name wins where both are set
    old = ServeConfig.from_env({"VHIDDEN_MAX_TOKENS": "55", "VHIDDEN_TIMEOUT": "3"})
    assert (old.max_hidden_tokens, old.timeout_s) == (55, 3.0)
    assert ServeConfig.from_env({"VHIDDEN_MAX_TOKENS": "55", "VHIDDEN_MAX_HIDDEN_TOKENS": "66"}).max_hidden_tokens == 66
    with pytest.raises(ValueError, match=r"--max-hidden-tokens \(VHIDDEN_MAX_HIDDEN_TOKENS\).*got 0"):
        ServeConfig(max_hidden_tokens=0)
    with pytest.raises(ValueError, match=r"VHIDDEN_MAX_REQUEST_BYTES must be a number, got 'lots'"):
        ServeConfig.from_env({"VHIDDEN_MAX_REQUEST_BYTES": "lots"})
    with pytest.raises(ValueError, match=r"--hidden-states-timeout"):
        ServeConfig(timeout_s=-1)


def _large_body_run(chunks: list[bytes], limit: int):
    """Run the middleware's over-limit path against a fake vLLM app that reads the body in
    pieces; returns (messages the client got, what the app saw)."""
    from vllm_hidden.server.asgi import ScanningReceive as _ScanningReceive
    from vllm_hidden.server.asgi import read_body as _read_body
    from vllm_hidden.server.middleware import HiddenStatesMiddleware

    seen = {"body": b"", "disconnect": False}

    async def inner(scope, receive, send):
        while True:
            msg = await receive()
            if msg["type"] == "http.disconnect":
                seen["disconnect"] = True
                raise RuntimeError("client went away")
            seen["body"] += msg.get("body", b"")
            if not msg.get("more_body"):
                break
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b'{"ok":1}', "more_body": False})

    mw = HiddenStatesMiddleware.__new__(HiddenStatesMiddleware)
    mw.app, mw._auth, mw._auth_checked = inner, None, True
    msgs = [{"type": "http.request", "body": c, "more_body": i < len(chunks) - 1} for i, c in enumerate(chunks)]
    sent = []

    async def receive():
        return msgs.pop(0) if msgs else {"type": "http.disconnect"}

    async def send(m):
        sent.append(m)

    async def go():
        head, complete = await _read_body(receive, limit)
        assert not complete
        await mw._pass_large({"type": "http", "path": "/v1/completions"}, _ScanningReceive(head, receive), send, limit)

    asyncio.run(go())
    return sent, seen


def test_an_over_limit_body_without_the_field_reaches_vllm_whole():
    chunks = [b'{"prompt": "' + b"x" * 50, b"y" * 50, b"z" * 50 + b'"}']
    sent, seen = _large_body_run(chunks, limit=60)
    assert seen["body"] == b"".join(chunks) and not seen["disconnect"]
    assert sent[0]["status"] == 200


def test_the_field_found_after_the_limit_is_a_413_even_split_across_chunks():
    chunks = [b'{"prompt": "' + b"x" * 70, b'", "hidden_', b'states": true}']
    sent, seen = _large_body_run(chunks, limit=60)
    assert seen["disconnect"]  # vLLM was told the client left, so it serves nothing
    assert sent[0]["status"] == 413 and len(sent) == 2
    assert b"at most 60 bytes" in bytes(sent[1]["body"])
