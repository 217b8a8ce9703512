"""A stream batch in speculators' training layout (`colocate.to_speculators`): the aux layers
side by side, the last captured layer as the verifier's, one packed row with each row's sample
index; fewer than two layers refused."""

import pytest
import torch

from vllm_hidden.colocate import to_speculators


def test_a_batch_in_speculators_layout():
    lengths, k, h = [3, 1, 4], 3, 5
    n = sum(lengths)
    hidden = torch.arange(n * k * h, dtype=torch.float32).reshape(n, k, h)
    batch = {"hidden_states": hidden, "token_ids": torch.arange(100, 100 + n),
             "position_ids": torch.cat([torch.arange(x) for x in lengths]),
             "loss_mask": torch.tensor([0, 1, 1, 1, 0, 0, 1, 1], dtype=torch.bool),
             "cu_seqlens": torch.tensor([0, 3, 4, 8], dtype=torch.int32)}
    out = to_speculators(batch)
    assert out["hidden_states"].shape == (1, n, (k - 1) * h)
    for t in range(n):  # row t: layer 0's h values, then layer 1's; the last layer apart
        assert out["hidden_states"][0, t].tolist() == hidden[t, 0].tolist() + hidden[t, 1].tolist()
        assert out["verifier_last_hidden_states"][0, t].tolist() == hidden[t, 2].tolist()
    assert out["document_ids"].tolist() == [[0, 0, 0, 1, 2, 2, 2, 2]]
    assert out["input_ids"].tolist() == [list(range(100, 108))]
    assert out["position_ids"].tolist() == [[0, 1, 2, 0, 0, 1, 2, 3]]
    assert out["loss_mask"].tolist() == [[False, True, True, True, False, False, True, True]]
    with pytest.raises(ValueError, match=r"at least 2 captured layers .* \(8, 1, 5\)"):
        to_speculators({**batch, "hidden_states": hidden[:, :1]})
