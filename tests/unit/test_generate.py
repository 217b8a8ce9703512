"""extract --generate without an engine: where the driver ends each response (stop tokens,
stop strings, --max-tokens, one token sampled past the end), per-sample seeds, and the
assembler's side: a generating request's rows held until its end is known, then handed to
the sink exactly as kept (real StepTransfer on CPU)."""

import json
import re

import pytest
import torch

from tests.outputs import shard_writer
from tests.unit.test_assembler_open_ended import H, Harness, K, truth
from vllm_hidden.capture import records
from vllm_hidden.capture.assembler import Assembler
from vllm_hidden.capture.memory import MemorySink
from vllm_hidden.capture.records import CaptureError, NewRequest, ResponseEnd, Rows, Segment, StepRecord
from vllm_hidden.capture.ring import StepTransfer
from vllm_hidden.capture.staging import StagePool
from vllm_hidden.config import GenerateConfig
from vllm_hidden.extract.generate import Ended, Responses, sample_seed
from vllm_hidden.inputs import BadLine, Prompt

EOS = 2


class Tok:
    """Decodes id i as the word w{i}; ids below 3 are special."""

    def decode(self, ids, skip_special_tokens=False):
        return " ".join(f"w{i}" for i in ids if not (skip_special_tokens and i < 3))


def _responses(max_prompt_len=None, loss_mask=None, **kw):
    return Responses(GenerateConfig(**{"max_tokens": 4, **kw}), {EOS}, Tok(), max_prompt_len=max_prompt_len,
                     loss_mask=loss_mask)


def _start(r, prompt=(10, 11, 12), spans=((1, 2),), source=None, line=0, turns=()):
    item = Prompt(line, f"id{line}", list(prompt), [tuple(s) for s in spans] if spans is not None else None,
                  source if source is not None else {"messages": [{"role": "user", "content": "q"}]}, turns)
    params = r.first(item).params
    return item, params


def test_length_end_keeps_max_tokens_once_one_more_was_sampled():
    r = _responses()
    item, params = _start(r)
    assert params.max_tokens == 5 and params.ignore_eos  # one past the end, EOS decided here
    assert params.extra_args["vllm_hidden_rows"] == 3 + 4 and params.extra_args["vllm_hidden_id"] == "id0"
    assert params.skip_reading_prefix_cache and params.extra_args["vllm_hidden_line"] == 0
    assert r.update("0", [20, 21], False) is None
    assert r.update("0", [22, 23], False) is None  # 4 kept, but the 4th's row is not computed yet
    got = r.update("0", [24], True)
    assert isinstance(got, Ended) and not got.abort and got.line == 0
    assert got.end.rows == 7 and got.end.token_ids == [10, 11, 12, 20, 21, 22, 23]
    assert got.end.loss_spans == [[1, 2], [3, 7]] and got.end.num_prompt == 3
    rec = json.loads(got.end.record)
    assert rec["finish_reason"] == "length" and rec["response_token_ids"] == [20, 21, 22, 23]
    assert rec["messages"][-1] == {"role": "assistant", "content": "w20 w21 w22 w23"}
    assert rec["num_generated_tokens"] == 4 and got.generated == 4 and got.rows == 7


def test_stop_token_is_kept_and_the_request_is_aborted_one_token_later():
    r = _responses(max_tokens=8)
    _start(r)
    assert r.update("0", [20, EOS], False) is None  # EOS is the last kept token: its row comes next step
    got = r.update("0", [30, 31], False)
    assert got.abort and got.end.token_ids[3:] == [20, EOS] and got.end.rows == 5
    assert json.loads(got.end.record)["finish_reason"] == "stop"
    assert json.loads(got.end.record)["response"] == "w20"  # special tokens left out of the text


def test_ignore_eos_and_stop_tokens_after_max_tokens():
    r = _responses(ignore_eos=True, max_tokens=3)
    _start(r)
    assert r.update("0", [EOS, 21, 22, EOS], False).end.token_ids[3:] == [EOS, 21, 22]
    r = _responses(max_tokens=2)
    _start(r)
    got = r.update("0", [20, 21, EOS], True)  # EOS past --max-tokens: the length end
    assert json.loads(got.end.record)["finish_reason"] == "length" and got.generated == 2


def test_stop_string_ends_with_the_token_that_completes_it():
    r = _responses(max_tokens=10, stop=("w22 w23",))
    _start(r)
    assert r.update("0", [21, 22], False) is None
    got = r.update("0", [23, 24, 25], False)
    assert got.end.token_ids[3:] == [21, 22, 23] and got.abort


def test_no_mask_stays_none_and_other_sources():
    r = _responses(max_tokens=1)
    _start(r, spans=None, source={"text": "a b"})
    got = r.update("0", [20, 21], False)
    rec = json.loads(got.end.record)
    assert got.end.loss_spans is None and rec["text"] == "a b" and "messages" not in rec


def test_an_engine_ending_early_keeps_what_has_rows_or_is_an_error_record():
    r = _responses(max_tokens=8)
    _start(r)
    got = r.update("0", [20, 21, 22], True)
    assert got.end.token_ids[3:] == [20, 21] and not got.abort
    r = _responses(max_tokens=8)
    _start(r)
    got = r.update("0", [20], True)
    assert isinstance(got.bad, BadLine) and got.end.drop and not got.rows


def test_sample_seeds_depend_on_run_seed_and_id_only():
    assert sample_seed(7, "a") == sample_seed(7, "a") != sample_seed(7, "b") != sample_seed(8, "a")
    assert 0 <= sample_seed(7, 123) < 2**62
    r = _responses(seed=7)
    _, params = _start(r)
    assert params.seed == sample_seed(7, "id0")
    assert _start(_responses())[1].seed is None


def test_stop_strings_need_a_tokenizer():
    with pytest.raises(ValueError, match="--stop needs the model's tokenizer"):
        Responses(GenerateConfig(stop=("x",)), {EOS}, None)


@pytest.mark.parametrize("name,value", [("max_tokens", 0), ("temperature", -1), ("top_p", 0), ("top_k", -2),
                                        ("seed", -1), ("stop", ("",))])
def test_generate_config_names_the_bad_value(name, value):
    shown = repr(value[0] if name == "stop" else value)
    with pytest.raises(ValueError, match=re.escape(f"--{name.replace('_', '-')}") + ".*" + re.escape(shown)):
        GenerateConfig(**{name: value})


class Sink(records.Sink):
    """Records add_rows calls (the shard writer's entry point for generated samples); a
    generated sample never reserves a slot."""

    def __init__(self):
        self.added = []

    def add_rows(self, sample_id, token_ids, rows, **kw):
        assert torch.equal(rows.row_scale, rows.values.float().abs().amax(-1))  # each row's row_scale rides with it
        self.added.append((sample_id, list(token_ids), rows.values.clone(), kw))

    def reserve(self, sample_id, token_ids, **kw):
        raise AssertionError(f"reserve({sample_id!r}) for a generated sample")

    def commit(self, slot):
        raise AssertionError("commit of a generated sample's slot")

    def drop(self, slot):
        raise AssertionError("drop of a generated sample's slot")


def _gen_harness():
    h = Harness(slots=2)
    h.sink = Sink()
    h.asm = Assembler(h.tr, h.sink)
    return h


def _end(rows, record="r\n", line=0, turn=0):
    return ResponseEnd(line, turn, rows=rows, token_ids=list(range(rows)), loss_spans=[[3, rows]], num_prompt=3,
                       record=record)


def test_generated_rows_wait_for_their_end_then_go_to_the_sink_as_kept():
    h = _gen_harness()
    new = {"r": NewRequest("s", [1, 2, 3], rows=3 + 6, line=4, generate=True)}
    h.step([("r", 0, 20, 0, 3)], new=new)  # prompt
    for pos in range(3, 7):  # decode rows
        h.step([("r", 0, 20, pos, 1)])
    assert h.sink.added == []
    h.asm.process(_record(ends=[_end(6, line=4)]))  # 6 rows kept: the 7th is past the end
    (sid, ids, rows, kw), = h.sink.added
    assert sid == "s" and ids == list(range(6)) and torch.equal(rows, truth(0, 20)[:6])
    assert kw["num_prompt"] == 3 and kw["record"] == "r\n" and kw["line"] == 4
    h.finish("r")  # the aborted request's finish: nothing more
    assert h.asm.in_flight == 0 and h.asm.dropped == []
    h.assert_all_slots_free()


def test_an_end_known_before_its_last_rows_waits_for_them_and_a_recompute_overwrites():
    h = _gen_harness()
    h.step([("r", 0, 20, 0, 4)], new={"r": NewRequest("s", [1, 2, 3, 4], rows=8, line=0, generate=True)})
    h.asm.process(_record(ends=[_end(6)]))
    assert h.sink.added == []
    h.step([("r", 0, 20, 0, 4)])  # preempted and recomputed from position 0: same places
    h.step([("r", 0, 20, 4, 2)])
    assert len(h.sink.added) == 1 and torch.equal(h.sink.added[0][2], truth(0, 20)[:6])


def test_a_request_finished_short_of_its_end_is_dropped_and_a_drop_end_frees_it():
    h = _gen_harness()
    h.step([("a", 0, 20, 0, 3), ("b", 1, 20, 0, 3)],
           new={"a": NewRequest("s", [1, 2, 3], rows=8, line=0, generate=True),
                "b": NewRequest("t", [1, 2, 3], rows=8, line=1, generate=True)})
    h.finish("a")
    h.asm.process(_record(ends=[_end(5), ResponseEnd(1, 0, drop="bad")]))
    assert h.sink.added == [] and h.asm.dropped == ["a"] and h.asm.in_flight == 0


def _record(ends):
    return StepRecord(None, 0, [], ends=ends)


def test_generated_sample_in_the_shard_writer_keeps_its_prompt_length_and_record(tmp_path):
    from safetensors import safe_open

    w = shard_writer(tmp_path, [0, 1], 4, dtype=torch.float32, loss_mask=True, final_state=True, generate=True)
    rows = torch.arange(6 * 3 * 4, dtype=torch.float32).reshape(6, 3, 4)  # 2 layers + the final state's column
    row_scale = rows.abs().amax(-1)
    w.add_rows("s", [5, 6, 7, 8, 9, 10], Rows(rows, row_scale), loss_spans=[[2, 6]], num_prompt=2,
               record='{"id": "s"}\n')
    with pytest.raises(ValueError, match="prompt length"):
        w.add_rows("t", [1], Rows(rows, row_scale)[:1], loss_spans=[], num_prompt=None, record="x\n")
    (info,) = w.close()
    with safe_open(str(tmp_path / info.file), framework="pt") as f:
        assert json.loads(f.metadata()["samples"]) == [["s", 0, 6, 2]]
        assert torch.equal(f.get_tensor("hidden_states"), rows[:, :2])
        assert torch.equal(f.get_tensor("final_hidden_states"), rows[:, 2])
        assert f.get_tensor("loss_mask").tolist() == [0, 0, 1, 1, 1, 1]
        assert f.get_tensor("generations").numpy().tobytes() == b'{"id": "s"}\n'


# --regenerate all: a conversation of three user turns. Each joint is the template's end of turn
# (EOS here, one token) and the next user turn with the generation prompt.
JOINTS = (([EOS, 60, 61, 62], 1), ([EOS, 70, 71], 1))
USERS = {"messages": [{"role": "user", "content": f"q{k}"} for k in range(3)]}


def _conversation(r):
    return _start(r, turns=JOINTS, source=USERS, spans=())


def test_turns_go_in_one_after_another_only_the_last_captured():
    r = _responses(seed=7, max_prompt_len=100)
    item, params = _conversation(r)
    # not the last turn: nothing captured, the prefix cache may be read, no token past the end
    assert params.extra_args is None and not getattr(params, "skip_reading_prefix_cache", False)
    assert params.max_tokens == 4 and params.seed == sample_seed(7, "id0")
    got = r.update("0", [20, 21, 22, 23], False)  # a length end: the template's end of turn is appended
    assert got.end is None and got.rows == 0 and got.abort
    nxt = got.next
    assert nxt.rid == "0.1" and nxt.token_ids == [10, 11, 12, 20, 21, 22, 23, EOS, 60, 61, 62]
    assert nxt.params.extra_args is None and nxt.params.seed == sample_seed(7, "id0", 1) != sample_seed(7, "id0")
    got = r.update("0.1", [30, EOS], False)  # ends with the end of turn itself: not appended twice
    last = got.next
    assert last.token_ids == nxt.token_ids + [30, EOS, 70, 71]
    ex = last.params.extra_args
    assert ex["vllm_hidden_turn"] == 2 and ex["vllm_hidden_rows"] == len(last.token_ids) + 4
    assert last.params.max_tokens == 5 and last.params.skip_reading_prefix_cache
    assert r.update("0.2", [40, 41, 42, 43], False) is None  # the last kept token's row is not computed yet
    got = r.update("0.2", [44], False)
    p2 = len(last.token_ids)
    end = got.end
    assert got.rows == p2 + 4 == end.rows and got.generated == 4 + 2 + 4
    assert end.token_ids == last.token_ids + [40, 41, 42, 43] and end.turn == 2 and end.num_prompt == 3
    # every response and its end of turn, the last as sampled
    assert end.loss_spans == [[3, 3 + 4 + 1], [11, 13], [p2, p2 + 4]]
    rec = json.loads(end.record)
    assert [t["token_ids"] for t in rec["turns"]] == [[20, 21, 22, 23], [30, EOS], [40, 41, 42, 43]]
    assert [t["finish_reason"] for t in rec["turns"]] == ["length", "stop", "length"]
    assert [m["content"] for m in rec["messages"]] == ["q0", "w20 w21 w22 w23", "q1", "w30", "q2",
                                                       "w40 w41 w42 w43"]
    assert rec["response_token_ids"] == [40, 41, 42, 43] and rec["num_generated_tokens"] == 10
    assert "stopped" not in rec


@pytest.mark.parametrize("rule,want", [("last-assistant", lambda p2: [[p2, p2 + 1]]),
                                       ("all", lambda p2: [[0, p2 + 1]])])
def test_turn_masks_follow_the_rule(rule, want):
    r = _responses(max_tokens=1, max_prompt_len=100, loss_mask=rule)
    _conversation(r)
    nxt = r.update("0", [20], False).next
    last = r.update("0.1", [30], False).next
    end = r.update("0.2", [40, 41], False).end
    assert end.loss_spans == want(len(last.token_ids)) and nxt.rid == "0.1"


def test_a_conversation_outgrowing_max_model_len_keeps_its_completed_turns():
    # the next turn might not fit after a full response: this turn is captured
    r = _responses(max_prompt_len=3 + 4 + 4 - 1)
    _, params = _conversation(r)
    assert params.extra_args["vllm_hidden_rows"] == 7 and params.max_tokens == 5
    got = r.update("0", [20, 21, 22, 23, 24], False)  # full length: turn 2 does not fit
    assert got.next is None and got.rows == 7 and got.end.token_ids == [10, 11, 12, 20, 21, 22, 23]
    assert got.end.loss_spans == [[3, 7]]  # as sampled: no end of turn appended
    rec = json.loads(got.end.record)
    assert "user turn 2" in rec["stopped"] and "11 tokens" in rec["stopped"] and len(rec["turns"]) == 1
    assert "max_model_len 14" in rec["stopped"]
    assert [m["content"] for m in rec["messages"]] == ["q0", "w20 w21 w22 w23"]
    # a short response: turn 2 fits after all; the captured rows of turn 1 go, turn 2 is captured
    r = _responses(max_prompt_len=3 + 4 + 4 - 1)
    _conversation(r)
    got = r.update("0", [20, EOS, 30], False)
    assert got.end == ResponseEnd(0, 0, drop="continued") and got.rows == 0
    assert got.next.token_ids == [10, 11, 12, 20, EOS, 60, 61, 62]
    assert got.next.params.extra_args["vllm_hidden_turn"] == 1


def test_a_staging_buffer_is_reused_only_once_the_sink_is_done_with_it():
    """A generating request's rows are staged until its end; the buffer serves a later request
    only after the sink said it reads it no more (`done`), and then holds that request's rows."""

    class Keeping(Sink):
        def add_rows(self, sample_id, token_ids, rows, **kw):
            super().add_rows(sample_id, token_ids, rows, **kw)
            self.added[-1] = (*self.added[-1], rows.values)  # the staged rows themselves, not a copy

    h = _gen_harness()
    h.sink = Keeping()
    h.asm = Assembler(h.tr, h.sink)

    def one(rid, sample, line):
        h.step([(rid, sample, 20, 0, 3)], new={rid: NewRequest(rid, [1, 2, 3], rows=8, line=line, generate=True)})
        h.asm.process(_record(ends=[_end(3, line=line)]))
        return h.sink.added[-1]

    a = one("a", 0, 0)
    b = one("b", 1, 1)  # a's buffer is still the sink's: b gets another
    assert b[4].data_ptr() != a[4].data_ptr() and torch.equal(a[4], truth(0, 20)[:3])
    a[3]["done"]()
    c = one("c", 2, 2)  # a's buffer again, with c's rows
    assert c[4].data_ptr() == a[4].data_ptr() and torch.equal(c[4], truth(2, 20)[:3])


def test_the_shard_writer_says_done_once_it_copied_a_generated_samples_rows(tmp_path):
    w = shard_writer(tmp_path, [0, 1], 4, dtype=torch.float32, generate=True)
    rows = torch.arange(6 * 2 * 4, dtype=torch.float32).reshape(6, 2, 4)
    calls = []
    w.add_rows("s", [5, 6, 7, 8, 9, 10], Rows(rows, rows.abs().amax(-1)), loss_spans=None, num_prompt=2, record="r\n",
               done=lambda: calls.append(rows.clone()))
    (info,) = w.close()
    assert len(calls) == 1 and torch.equal(calls[0], rows)
    from safetensors import safe_open

    with safe_open(str(tmp_path / info.file), framework="pt") as f:
        assert torch.equal(f.get_tensor("hidden_states")[:6], calls[0])


# Many generating requests at once: a step's rows are placed with a scatter per slab of staging
# buffers, not a copy per request (`Assembler._place_generated`).


def _vals(sample, length):
    """Distinct rows per (sample, position), their spreads differing row to row (so do their row sums)."""
    t = torch.arange(length * K * H, dtype=torch.float32).reshape(length, K, H)
    return t * (1 + torch.arange(length) % 5)[:, None, None] + 100000 * sample


class _Ring:
    """A real ring (CPU), with row sums, feeding an assembler; keeps the statistic and row sums
    it computed for each (sample, position), to check what reaches the sink."""

    def __init__(self, sink, max_tokens=64, row_sums=True, slab_rows=None):
        self.tr = StepTransfer(max_tokens, K, H, torch.float32, torch.device("cpu"), 2, row_sums=row_sums)
        self.asm = Assembler(self.tr, sink)
        if slab_rows is not None:  # small slabs: requests spread over several
            row_bytes = 4 * (K * H + K * (3 if row_sums else 1))
            self.asm._stages = StagePool(slab_bytes=slab_rows * row_bytes)
        self.seen = {}

    def step(self, parts, new=None, ends=(), listed=list):
        """parts: (req_id, sample, pos, count); the rows are _vals(sample, ...)[pos : pos + count], in
        this order; the record lists their segments in `listed(segments)`'s order."""
        rows, segs, r = [], [], 0
        for rid, s, pos, count in parts:
            rows.append(_vals(s, pos + count)[pos:])
            segs.append(Segment(rid, r, count, pos))
            r += count
        step = torch.cat(rows)
        slot = self.tr.acquire(timeout=5)
        self.tr.submit([step[:, k].contiguous() for k in range(K)], r, slot)
        row_sums = self.tr.host_row_sums[slot]
        for (_, s, pos, count), seg in zip(parts, segs):
            for j in range(count):
                i = seg.row + j
                self.seen[s, pos + j] = (self.tr.host_row_scale[slot][i].clone(),
                                         None if row_sums is None else row_sums[i].clone())
        self.asm.process(StepRecord(slot, r, list(listed(segs)), new or {}, ends=list(ends)))

    def check(self, sample, rows, row_scale, row_sums):
        assert torch.equal(rows, _vals(sample, rows.shape[0])), sample
        want = [self.seen[sample, p] for p in range(rows.shape[0])]
        assert torch.equal(row_scale, torch.stack([w[0] for w in want])), sample
        if row_sums is not None:
            assert torch.equal(row_sums, torch.stack([w[1] for w in want])), sample


class _Keep(Sink):
    """Keeps copies of each sample's rows, statistics and row sums, and its `done`."""

    def add_rows(self, sample_id, token_ids, rows, **kw):
        super().add_rows(sample_id, token_ids, rows, **kw)
        m = rows.row_sums
        self.added[-1] = (sample_id, rows.values.clone(), rows.row_scale.clone(), None if m is None else m.clone(),
                          kw["done"])


def _gen(rid, prompt, rows, line):
    return NewRequest(rid, list(range(prompt)), rows=rows, line=line, generate=True)


@pytest.mark.parametrize("with_sums", [True, False])
def test_many_generating_requests_decoding_together_each_get_their_own_rows(with_sums):
    sink = _Keep()
    ring = _Ring(sink, row_sums=with_sums, slab_rows=3 * 128)  # 3 requests a slab
    n, decode = 20, 4
    g = torch.Generator().manual_seed(0)
    for wave in range(2):  # the second wave's buffers: the first's, given back in random order
        first = wave * n
        prompts = {first + i: 2 + (i + wave) % 3 for i in range(n)}
        ring.step([(str(s), s, 0, p) for s, p in prompts.items()],
                  new={str(s): _gen(str(s), p, p + decode, s) for s, p in prompts.items()})
        for j in range(decode):  # a slab's rows side by side (segments listed in their order, then not), or not
            order = list(prompts) if j < 2 else [list(prompts)[i] for i in torch.randperm(n, generator=g)]
            ring.step([(str(s), s, prompts[s] + j, 1) for s in order], listed=reversed if j == 1 else list)
        assert sink.added == []
        ring.asm.process(StepRecord(None, 0, [], ends=[_end(p + decode, line=s) for s, p in prompts.items()]))
        assert sorted(a[0] for a in sink.added) == sorted(str(s) for s in prompts)
        for sid, rows, row_scale, row_sums, _ in sink.added:
            assert (row_sums is not None) == with_sums
            ring.check(int(sid), rows, row_scale, row_sums)
        for i in torch.randperm(n, generator=g).tolist():
            sink.added[i][4]()
        sink.added.clear()
    assert len(ring.asm._stages._slabs) == -(-n // 3) and ring.asm.in_flight == 0


def test_prefill_chunks_and_decode_rows_in_one_step_with_a_request_not_generating():
    out = []
    sink = MemorySink((K, H), torch.float32, out.append)
    ring = _Ring(sink, max_tokens=160, row_sums=False)
    # a generating request's long chunk (a copy of its own), a short one (scattered), decode rows, and a
    # request not generating (the sink's slot) in the same steps
    ring.step([("a", 1, 0, 2), ("b", 2, 0, 70), ("a", 1, 2, 1), ("n", 3, 0, 4)],  # a's in two segments
              new={"a": _gen("a", 3, 6, 1), "b": _gen("b", 100, 110, 2), "n": NewRequest("sn", list(range(6)))})
    ring.step([("a", 1, 3, 1), ("c", 4, 0, 80), ("b", 2, 70, 30), ("n", 3, 4, 2)],
              new={"c": _gen("c", 80, 90, 4)})
    assert [s.sample_id for s in out] == ["sn"]
    ring.step([("c", 4, 80, 1), ("a", 1, 4, 1), ("b", 2, 100, 1)], ends=[_end(5, line=1)])
    ring.step([("b", 2, 101, 1), ("c", 4, 81, 1)], ends=[_end(102, line=2), _end(82, line=4)])
    assert [s.sample_id for s in out] == ["sn", "a", "b", "c"]
    for s in out:
        ring.check({"sn": 3, "a": 1, "b": 2, "c": 4}[s.sample_id], s.hidden_states,
                   s.hidden_states.abs().amax(-1), None)
    assert ring.asm.in_flight == 0


def test_a_recompute_from_position_zero_overwrites_rows_while_others_decode():
    sink = _Keep()
    ring = _Ring(sink, slab_rows=128)  # one request a slab
    ring.step([("a", 1, 0, 3), ("b", 2, 0, 3)], new={"a": _gen("a", 3, 8, 1), "b": _gen("b", 3, 8, 2)})
    ring.step([("a", 1, 3, 1), ("b", 2, 3, 1)])
    ring.step([("b", 2, 4, 1), ("a", 9, 4, 1)])  # a's row at 4 was wrong: its recompute must replace it
    # a preempted: computed again from position 0 in two chunks, b decoding beside it
    ring.step([("b", 2, 5, 1), ("a", 1, 0, 2)])
    ring.step([("a", 1, 2, 3), ("b", 2, 6, 1)], ends=[_end(7, line=2)])
    ring.step([("a", 1, 5, 2)], ends=[_end(7, line=1)])
    assert [x[0] for x in sink.added] == ["b", "a"]
    for sid, rows, row_scale, row_sums, _ in sink.added:
        ring.check({"a": 1, "b": 2}[sid], rows, row_scale, row_sums)


def test_a_generating_request_skipping_rows_fails_alone_in_its_step():
    reasons = []

    class Reporting(_Keep):
        def on_failure(self, sample_id, reason):
            reasons.append((sample_id, reason))
            return True

    sink = Reporting()
    ring = _Ring(sink, slab_rows=128)
    ring.step([("a", 1, 0, 3), ("b", 2, 0, 3)], new={"a": _gen("a", 3, 8, 1), "b": _gen("b", 3, 8, 2)})
    ring.step([("a", 1, 3, 1), ("b", 2, 5, 1)], ends=[_end(4, line=1)])  # b: rows 3 and 4 never came
    assert [r[0] for r in reasons] == ["b"] and "position 5 but 3 rows" in reasons[0][1]
    (sid, rows, row_scale, row_sums, done), = sink.added
    assert sid == "a"
    ring.check(1, rows, row_scale, row_sums)
    assert ring.asm.in_flight == 0
    pool = ring.asm._stages
    assert [s.live for s in pool._slabs] == [1, 0]  # b's buffer back at once, a's once the sink is done
    done()
    assert len(pool._slabs) == 2 and all(s.live == 0 for s in pool._slabs)
    # without a sink taking the failure, it is raised
    ring = _Ring(_Keep(), slab_rows=128)
    ring.step([("b", 2, 0, 3)], new={"b": _gen("b", 3, 8, 2)})
    with pytest.raises(CaptureError, match="position 4 but 3 rows"):
        ring.step([("b", 2, 4, 1)])


def test_the_stage_pool_cuts_ranges_from_slabs_reuses_them_and_keeps_empty_slabs_up_to_its_cap():
    tr = StepTransfer(4, K, H, torch.float32, torch.device("cpu"), 2)
    ring = (tr.host[0], tr.host_row_scale[0], None)
    row = 4 * (K * H + K)
    pool = StagePool(cap_bytes=2 * 256 * row, slab_bytes=256 * row)  # slabs of 256 rows, two of them kept
    a, b = pool.take(100, *ring), pool.take(128, *ring)
    assert a.slab is b.slab and (a.offset, a.rows, b.offset) == (0, 128, 128) and a.buf.shape[0] == 128
    c = pool.take(300, *ring)  # more than a slab: a slab of its own
    assert c.slab is not a.slab and c.slab.rows == c.rows == 384
    pool.give(a)
    d = pool.take(50, *ring)  # a's range
    assert (d.slab, d.offset) == (a.slab, 0)
    e = pool.take(128, *ring)  # nothing given back, no room left: a new slab
    assert e.slab not in (a.slab, c.slab) and len(pool._slabs) == 3
    pool.give(b)
    pool.give(d)  # a's slab empty with 3 slabs held (> cap): released
    pool.give(c)  # so is c's
    assert pool._slabs == [e.slab]
    pool.give(e)  # kept, empty
    f = pool.take(256, *ring)
    assert (f.slab, f.offset) == (e.slab, 0)
    pool = StagePool(slab_bytes=512 * row)
    g = pool.take(128, *ring)
    pool.give(pool.take(256, *ring))  # [128, 384) given back while g is in use
    h = pool.take(128, *ring)  # the rest of the slab first
    i = pool.take(1, *ring)  # no room, none of its size given back: the larger range rather than a new slab
    assert (h.offset, i.offset, i.rows) == (384, 128, 256) and len(pool._slabs) == 1
    for s in (g, h, i):
        pool.give(s)
    j = pool.take(512, *ring)  # empty: cut afresh
    assert (j.slab, j.offset) == (g.slab, 0) and len(pool._slabs) == 1 and not any(pool._free.values())
    # cap 0: nothing kept, every range fresh
    pool = StagePool(cap_bytes=0, slab_bytes=256 * row)
    k = pool.take(128, *ring)
    m = pool.take(128, *ring)
    pool.give(k)
    n = pool.take(128, *ring)
    assert n.slab is not k.slab and pool._slabs == [k.slab, n.slab]
    pool.give(m)
    assert pool._slabs == [n.slab]


def test_a_response_end_crosses_to_the_worker_as_a_plain_dict():
    """The driver sends ends over vLLM's RPC as dicts (any serializer carries them); the worker
    gets back the same ends."""
    ends = [_end(7, line=3, turn=1), ResponseEnd(4, 2, drop="continued")]
    wire = [e.to_dict() for e in ends]
    assert all(type(d) is dict for d in wire) and json.loads(json.dumps(wire)) == wire
    assert [ResponseEnd.from_dict(d) for d in wire] == ends
