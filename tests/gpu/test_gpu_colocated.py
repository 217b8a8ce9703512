"""GPU host only (skipped without CUDA): colocated training (scripts/colocated_train.py on
`HiddenStatesStream`) with the target compiled and under CUDA graphs on the GPU, killed and
resumed: every sample once, HF parity on every captured layer and the final state, the batches'
tensors on the GPU and no step copied to the host; and responses written by the target
(`generate`) with their states (tests/integration/test_colocate.py's checks)."""

import pytest
import torch

from tests.integration.test_colocate import generated_with_states, killed_then_resumed

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def test_gpu_colocated_killed_then_resumed_matches_hf(tiny_models, tmp_path):
    res = killed_then_resumed(tiny_models, tmp_path,
                              "--gdn-prefill-backend triton --gpu-memory-utilization 0.3 --max-num-seqs 8")
    assert res["device"].startswith("cuda"), res["device"]


def test_gpu_colocated_generated_responses_match_hf(tiny_models, tmp_path):
    res = generated_with_states(tiny_models, tmp_path,
                                "--gdn-prefill-backend triton --gpu-memory-utilization 0.3 --max-num-seqs 8", "tiny")
    assert res["device"].startswith("cuda"), res["device"]
