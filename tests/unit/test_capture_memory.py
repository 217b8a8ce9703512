"""The capture path's device memory: what each layout allocates (counted here from the shapes,
not from the code under test), and the layout the starting command names in the environment,
so that the worker allocates at load, inside vLLM's memory profile, what its sink keeps."""

from __future__ import annotations

import pytest
import torch

from vllm_hidden.capture.ring import StepTransfer
from vllm_hidden.config import CaptureLayout, ConnectorConfig, ExtractConfig, ShardConfig

N, K, H = 512, 4, 64  # tokens per step, columns, hidden size


def _transfer(layout: CaptureLayout) -> StepTransfer:
    return StepTransfer(N, K + layout.final_state, H, torch.bfloat16, torch.device("cpu"), fp8=layout.fp8,
                        per_token=layout.per_token, row_sums=layout.row_sums)


@pytest.mark.parametrize("layout, expected", [
    # bf16 values + one float32 amax per (token, column)
    (CaptureLayout(), {"rows": N * (K * H * 2 + 4 * K)}),
    # + the final state's column
    (CaptureLayout(final_state=True), {"rows": N * ((K + 1) * H * 2 + 4 * (K + 1))}),
    # + sum and centred sum of squares per (token, column) in the rows, their float32 outputs, and the
    #   reduction's float32 scratch (2**19 values on the CPU: at least one row of K x H)
    (CaptureLayout(row_sums=True), {"rows": N * (K * H * 2 + 3 * 4 * K), "row_sums": 2 * N * K * 4 + 4 * 2**19}),
    # fp8 values + a scale per (token, column); the bf16 gather and a float32 [N, K] work space
    (CaptureLayout(fp8=True), {"rows": N * (K * H + 4 * K), "fp8": N * K * H * 2 + N * K * 4}),
    # hs_connectors' per-token scales: one more float32 per token of work space
    (CaptureLayout(fp8=True, per_token=True), {"rows": N * (K * H + 4 * K), "fp8": N * K * H * 2 + N * K * 4 + N * 4}),
])
def test_device_bytes_of_each_layout(layout, expected):
    assert _transfer(layout).device_bytes() == expected


def test_the_layout_goes_to_the_worker_through_the_environment():
    for layout in (CaptureLayout(), CaptureLayout(final_state=True, fp8=True, row_sums=True),
                   CaptureLayout(fp8=True, per_token=True)):
        assert CaptureLayout.from_env(layout.to_env()) == layout
    assert CaptureLayout.from_env({}) is None
    with pytest.raises(ValueError, match="VHIDDEN_CAPTURE_LAYOUT is not a capture layout"):
        CaptureLayout.from_env({CaptureLayout.ENV: '{"fp8": true}'})
    with pytest.raises(ValueError, match="per_token .* needs fp8=True"):
        CaptureLayout(per_token=True)
    with pytest.raises(ValueError, match="row_sums must be a bool, got 1"):
        CaptureLayout(row_sums=1)


def test_each_command_names_the_layout_its_sink_opens_with():
    """An extract's layout is its shards' (what the worker's open() asks for); a server's has
    layers only, fp8 per token for hs_connectors' FP8 connector."""
    cfg = ExtractConfig(model="m", input_path="i", output_dir="o", final_state="post-norm", storage_dtype="fp8")
    shard = ShardConfig(output_dir="o", **cfg.shard_options())
    assert cfg.capture_layout() == CaptureLayout.for_shards(shard) == CaptureLayout(
        final_state=True, fp8=True, row_sums=shard.layer_stats)
    assert CaptureLayout.for_server(None) == CaptureLayout()
    fp8 = ConnectorConfig(connector="FP8HiddenStatesConnector", storage_path="/tmp/x", aux_layer_ids=(2, 4))
    assert CaptureLayout.for_server(fp8) == CaptureLayout(fp8=True, per_token=True)
