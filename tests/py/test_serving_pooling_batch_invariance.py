"""VLLM_BATCH_INVARIANT=1 under `--runner pooling`: an input's output is bit-identical
alone, in a batch of 64 mixed-length inputs and in the same batch reversed (other
neighbours in every step). For a decoder classifier (tiny random
Qwen3ForSequenceClassification, last-token pooling, its score layer a torch head; a 64-token
budget, so long prompts are split by chunked prefill differently in each composition) and
for an encoder (all-MiniLM-L6-v2, mean pooling, whole prompts per step). Without the switch
the same batches differ in the last bits (docs/serving.md, "Batch invariance"), which is what
makes this check able to fail."""

from __future__ import annotations

import base64

import numpy as np
import pytest

from pooling_checkpoint import VOCAB, write_classifier
from pooling_reference import minilm_dir_or_skip
from serving_harness import Server

pytestmark = [pytest.mark.slow, pytest.mark.serving]

INVARIANT = {"VLLM_BATCH_INVARIANT": "1"}
DECODER_ARGS = ["--runner", "pooling", "--dtype", "float32", "--max-model-len", "256",
                "--max-num-seqs", "32", "--max-num-batched-tokens", "64",
                "--kv-cache-memory-bytes", str(64 << 20)]
ENCODER_ARGS = ["--runner", "pooling", "--dtype", "float32", "--max-num-seqs", "64"]


def _embed(server, inputs) -> list[np.ndarray]:
    """The float32 embeddings exactly as sent (base64: no decimal round trip)."""
    r = server.client.post("/v1/embeddings", json={"model": server.name, "input": inputs,
                                                   "encoding_format": "base64"})
    assert r.status_code == 200, r.text
    data = sorted(r.json()["data"], key=lambda d: d["index"])
    return [np.frombuffer(base64.b64decode(d["embedding"]), np.float32) for d in data]


def _classify(server, inputs) -> list[np.ndarray]:
    """The raw scores (float32 values; JSON's shortest repr reads back to the same bits)."""
    r = server.client.post("/classify", json={"model": server.name, "input": inputs,
                                              "use_activation": False})
    assert r.status_code == 200, r.text
    data = sorted(r.json()["data"], key=lambda d: d["index"])
    return [np.array(d["probs"], np.float32) for d in data]


def _differing(server, prompts, outputs) -> tuple[list[int], list[int]]:
    """Indices whose output alone, and in the reversed batch, is not bitwise the batch's."""
    together = outputs(server, prompts)
    reversed_ = outputs(server, prompts[::-1])[::-1]
    alone = [outputs(server, [p])[0] for p in prompts]
    return ([i for i, a in enumerate(alone) if not np.array_equal(a, together[i])],
            [i for i, r in enumerate(reversed_) if not np.array_equal(r, together[i])])


@pytest.fixture(scope="module")
def classifier(tmp_path_factory):
    model = write_classifier(tmp_path_factory.mktemp("classifier"), num_labels=3)
    s = Server(str(model), "classifier", DECODER_ARGS, env=INVARIANT)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def minilm():
    s = Server(str(minilm_dir_or_skip()), "minilm", ENCODER_ARGS, env=INVARIANT)
    yield s
    s.stop()


def test_decoder_scores_are_bitwise_the_same_in_any_batch(classifier):
    rng = np.random.default_rng(3)
    # lengths 1-200 against a 64-token budget: many prompts arrive in chunks
    prompts = [rng.integers(3, VOCAB, int(n)).tolist() for n in rng.integers(1, 200, 64)]
    alone, reordered = _differing(classifier, prompts, _classify)
    assert alone == [] and reordered == []
    assert classifier.alive()


def test_encoder_embeddings_are_bitwise_the_same_in_any_batch(minilm):
    rng = np.random.default_rng(0)  # a batch whose rows differ without the switch
    prompts = [[101, *rng.integers(2000, 6000, int(n)).tolist(), 102] for n in rng.integers(1, 120, 64)]
    alone, reordered = _differing(minilm, prompts, _embed)
    assert alone == [] and reordered == []
    assert minilm.alive()
