"""extract --generate without an engine: where the driver ends each response (stop tokens,
stop strings, --max-tokens, one token sampled past the end), per-sample seeds, and the
assembler's side: a generating request's rows held until its end is known, then handed to
the sink exactly as kept (real StepTransfer on CPU)."""

import json
import re

import pytest
import torch

from tests.outputs import shard_writer
from tests.unit.test_assembler_open_ended import Harness, truth
from vllm_hidden.capture import records
from vllm_hidden.capture.assembler import Assembler
from vllm_hidden.capture.records import NewRequest
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
    assert got.end["rows"] == 7 and got.end["token_ids"] == [10, 11, 12, 20, 21, 22, 23]
    assert got.end["loss_spans"] == [[1, 2], [3, 7]] and got.end["num_prompt"] == 3
    rec = json.loads(got.end["record"])
    assert rec["finish_reason"] == "length" and rec["response_token_ids"] == [20, 21, 22, 23]
    assert rec["messages"][-1] == {"role": "assistant", "content": "w20 w21 w22 w23"}
    assert rec["num_generated_tokens"] == 4 and got.generated == 4 and got.rows == 7


def test_stop_token_is_kept_and_the_request_is_aborted_one_token_later():
    r = _responses(max_tokens=8)
    _start(r)
    assert r.update("0", [20, EOS], False) is None  # EOS is the last kept token: its row comes next step
    got = r.update("0", [30, 31], False)
    assert got.abort and got.end["token_ids"][3:] == [20, EOS] and got.end["rows"] == 5
    assert json.loads(got.end["record"])["finish_reason"] == "stop"
    assert json.loads(got.end["record"])["response"] == "w20"  # special tokens left out of the text


def test_ignore_eos_and_stop_tokens_after_max_tokens():
    r = _responses(ignore_eos=True, max_tokens=3)
    _start(r)
    assert r.update("0", [EOS, 21, 22, EOS], False).end["token_ids"][3:] == [EOS, 21, 22]
    r = _responses(max_tokens=2)
    _start(r)
    got = r.update("0", [20, 21, EOS], True)  # EOS past --max-tokens: the length end
    assert json.loads(got.end["record"])["finish_reason"] == "length" and got.generated == 2


def test_stop_string_ends_with_the_token_that_completes_it():
    r = _responses(max_tokens=10, stop=("w22 w23",))
    _start(r)
    assert r.update("0", [21, 22], False) is None
    got = r.update("0", [23, 24, 25], False)
    assert got.end["token_ids"][3:] == [21, 22, 23] and got.abort


def test_no_mask_stays_none_and_other_sources():
    r = _responses(max_tokens=1)
    _start(r, spans=None, source={"text": "a b"})
    got = r.update("0", [20, 21], False)
    rec = json.loads(got.end["record"])
    assert got.end["loss_spans"] is None and rec["text"] == "a b" and "messages" not in rec


def test_an_engine_ending_early_keeps_what_has_rows_or_is_an_error_record():
    r = _responses(max_tokens=8)
    _start(r)
    got = r.update("0", [20, 21, 22], True)
    assert got.end["token_ids"][3:] == [20, 21] and not got.abort
    r = _responses(max_tokens=8)
    _start(r)
    got = r.update("0", [20], True)
    assert isinstance(got.bad, BadLine) and got.end["drop"] and not got.rows


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

    def add_rows(self, sample_id, token_ids, rows, stat, **kw):
        assert torch.equal(stat, rows.float().abs().amax(-1))  # each row's statistic rides with it
        self.added.append((sample_id, list(token_ids), rows.clone(), kw))

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
    return {"line": line, "turn": turn, "rows": rows, "token_ids": list(range(rows)), "loss_spans": [[3, rows]],
            "num_prompt": 3, "record": record}


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
    h.asm.process(_record(ends=[_end(5), {"line": 1, "turn": 0, "drop": "bad"}]))
    assert h.sink.added == [] and h.asm.dropped == ["a"] and h.asm.in_flight == 0


def _record(ends):
    from vllm_hidden.capture.records import StepRecord

    return StepRecord(None, 0, [], ends=ends)


def test_generated_sample_in_the_shard_writer_keeps_its_prompt_length_and_record(tmp_path):
    from safetensors import safe_open

    w = shard_writer(tmp_path, [0, 1], 4, dtype=torch.float32, loss_mask=True, final_state=True, generate=True)
    rows = torch.arange(6 * 3 * 4, dtype=torch.float32).reshape(6, 3, 4)  # 2 layers + the final state's column
    stat = rows.abs().amax(-1)
    w.add_rows("s", [5, 6, 7, 8, 9, 10], rows, stat, loss_spans=[[2, 6]], num_prompt=2, record='{"id": "s"}\n')
    with pytest.raises(ValueError, match="prompt length"):
        w.add_rows("t", [1], rows[:1], stat[:1], loss_spans=[], num_prompt=None, record="x\n")
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
    assert got.rows == p2 + 4 == end["rows"] and got.generated == 4 + 2 + 4
    assert end["token_ids"] == last.token_ids + [40, 41, 42, 43] and end["turn"] == 2 and end["num_prompt"] == 3
    # every response and its end of turn, the last as sampled
    assert end["loss_spans"] == [[3, 3 + 4 + 1], [11, 13], [p2, p2 + 4]]
    rec = json.loads(end["record"])
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
    assert end["loss_spans"] == want(len(last.token_ids)) and nxt.rid == "0.1"


def test_a_conversation_outgrowing_max_model_len_keeps_its_completed_turns():
    # the next turn might not fit after a full response: this turn is captured
    r = _responses(max_prompt_len=3 + 4 + 4 - 1)
    _, params = _conversation(r)
    assert params.extra_args["vllm_hidden_rows"] == 7 and params.max_tokens == 5
    got = r.update("0", [20, 21, 22, 23, 24], False)  # full length: turn 2 does not fit
    assert got.next is None and got.rows == 7 and got.end["token_ids"] == [10, 11, 12, 20, 21, 22, 23]
    assert got.end["loss_spans"] == [[3, 7]]  # as sampled: no end of turn appended
    rec = json.loads(got.end["record"])
    assert "user turn 2" in rec["stopped"] and "11 tokens" in rec["stopped"] and len(rec["turns"]) == 1
    assert "max_model_len 14" in rec["stopped"]
    assert [m["content"] for m in rec["messages"]] == ["q0", "w20 w21 w22 w23"]
    # a short response: turn 2 fits after all; the captured rows of turn 1 go, turn 2 is captured
    r = _responses(max_prompt_len=3 + 4 + 4 - 1)
    _conversation(r)
    got = r.update("0", [20, EOS, 30], False)
    assert got.end == {"line": 0, "turn": 0, "drop": "continued"} and got.rows == 0
    assert got.next.token_ids == [10, 11, 12, 20, EOS, 60, 61, 62]
    assert got.next.params.extra_args["vllm_hidden_turn"] == 1


def test_a_staging_buffer_is_reused_only_once_the_sink_is_done_with_it():
    """A generating request's rows are staged until its end; the buffer serves a later request
    only after the sink said it reads it no more (`done`), and then holds that request's rows."""

    class Keeping(Sink):
        def add_rows(self, sample_id, token_ids, rows, stat, **kw):
            super().add_rows(sample_id, token_ids, rows, stat, **kw)
            self.added[-1] = (*self.added[-1], rows)  # the staged rows themselves, not a copy

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
    w.add_rows("s", [5, 6, 7, 8, 9, 10], rows, rows.abs().amax(-1), loss_spans=None, num_prompt=2, record="r\n",
               done=lambda: calls.append(rows.clone()))
    (info,) = w.close()
    assert len(calls) == 1 and torch.equal(calls[0], rows)
    from safetensors import safe_open

    with safe_open(str(tmp_path / info.file), framework="pt") as f:
        assert torch.equal(f.get_tensor("hidden_states")[:6], calls[0])
