"""ALiBi's slopes (kvserve.model.attention.alibi_slopes) are Bloom's and MPT's, for head counts that are powers of two and
not; and the general attention path biases each head's scores by them."""

import pytest
import torch

from kvserve.model.attention import alibi_slopes


@pytest.mark.parametrize("heads", [4, 6, 8, 12, 20, 32])
def test_the_slopes_are_bloom_s_and_mpt_s(heads):
    from transformers.models.bloom.modeling_bloom import _get_alibi_slopes
    from transformers.models.mpt.modeling_mpt import build_mpt_alibi_tensor

    torch.testing.assert_close(torch.tensor(alibi_slopes(heads)), _get_alibi_slopes(heads, torch.device("cpu")))
    mpt = build_mpt_alibi_tensor(heads, 2)[:, 0, 0]  # the bias of the key one behind: -slope
    torch.testing.assert_close(torch.tensor(alibi_slopes(heads, mpt=True)), -mpt)
