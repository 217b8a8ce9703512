"""vLLM's arguments read by one rule (engine/flags.py): both spellings, `=` and spaced values,
values up to the next option, negative numbers as values, the last occurrence winning."""

from __future__ import annotations

import pytest

from vllm_hidden.engine import flags


def test_values_last_and_given_read_both_spellings_and_forms():
    args = ["serve", "m", "--max_model_len", "9", "--dtype=half", "-tp", "2", "--seed", "-1", "--enforce-eager",
            "--max-model-len=10"]
    assert flags.values(args, ("--max-model-len",)) == ["9", "10"]
    assert flags.last(args, ("--max-model-len",)) == "10"  # vLLM takes the last
    assert flags.last(args, ("--dtype",)) == "half" and flags.last(args, ("--tensor-parallel-size", "-tp")) == "2"
    assert flags.last(args, ("--seed",)) == "-1"  # a negative number is a value
    assert flags.last(args, ("--enforce-eager",)) is None and flags.given(args, ("--enforce-eager",))
    assert flags.last(args, ("--quantization",)) is None and not flags.given(args, ("--quantization",))
    assert flags.values(["--a", "--b", "1"], ("--a",)) == []  # an option follows: no value


def test_take_returns_the_last_value_and_the_rest():
    args = ["--x", "1", "--speculative_config", "{}", "--y=2", "-sc", '{"a": 1}', "--z"]
    value, rest = flags.take(args, ("--speculative-config", "-sc"))
    assert value == '{"a": 1}' and rest == ["--x", "1", "--y=2", "--z"]
    assert flags.take(["--x"], ("--y",)) == (None, ["--x"])
    with pytest.raises(ValueError, match="--kv-transfer-config needs a value"):
        flags.take(["--kv_transfer_config"], ("--kv-transfer-config",))


def test_options_skip_what_is_not_a_string():
    assert flags.last([None, 3, "--distributed-executor-backend", "ray"], ("--distributed-executor-backend",)) == "ray"
