"""models/token_classifier.py: vLLM's classifier-from-token score layers, built from the
LM-head rows of a safetensors checkpoint (NumPy on the saved weights as the reference)."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from vllm_metal.models.token_classifier import (classifier_method, score_weight_from_tokens,
                                                token_ids_of)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    from safetensors.numpy import save_file

    rng = np.random.default_rng(0)
    embed, head = rng.standard_normal((10, 4)).astype(np.float32), rng.standard_normal((10, 4)).astype(np.float32)
    untied, tied = tmp_path_factory.mktemp("untied"), tmp_path_factory.mktemp("tied")
    save_file({"model.embed_tokens.weight": embed, "lm_head.weight": head}, str(untied / "model.safetensors"))
    save_file({"model.embed_tokens.weight": embed}, str(tied / "model.safetensors"))
    return untied, tied, embed, head


def test_two_way_softmax_is_true_minus_false(checkpoints):
    untied, tied, embed, head = checkpoints
    np.testing.assert_array_equal(score_weight_from_tokens(str(untied), "from_2_way_softmax", [3, 7], False),
                                  (head[7] - head[3])[None])
    np.testing.assert_array_equal(score_weight_from_tokens(str(tied), "from_2_way_softmax", [3, 7], True),
                                  (embed[7] - embed[3])[None])


def test_no_post_processing_takes_the_rows(checkpoints):
    untied, _, _, head = checkpoints
    np.testing.assert_array_equal(score_weight_from_tokens(str(untied), "no_post_processing", [5, 1, 2], False),
                                  head[[5, 1, 2]])


def test_config_and_tokens():
    cfg = SimpleNamespace(method="from_2_way_softmax", classifier_from_token=["no", "yes"])
    assert classifier_method(cfg) == ("from_2_way_softmax", ["no", "yes"])
    assert classifier_method(SimpleNamespace()) is None
    with pytest.raises(ValueError, match="not supported"):
        classifier_method(SimpleNamespace(method="mean_of_tokens", classifier_from_token=["a"]))
    with pytest.raises(ValueError, match=r"\[false, true\]"):
        classifier_method(SimpleNamespace(method="from_2_way_softmax", classifier_from_token=["yes"]))
    tok = SimpleNamespace(get_vocab=lambda: {"no": 4, "yes": 9})
    assert token_ids_of(tok, ["no", "yes"]) == [4, 9]
    with pytest.raises(ValueError, match="maybe"):
        token_ids_of(tok, ["no", "maybe"])


def test_gguf_directory_is_refused(tmp_path):
    with pytest.raises(ValueError, match="safetensors"):
        score_weight_from_tokens(str(tmp_path), "from_2_way_softmax", [0, 1], False)
