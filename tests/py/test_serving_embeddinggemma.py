"""EmbeddingGemma (Gemma 3 text, bidirectional attention, models/gemma3_encoder.py):
the encoder on packed batches, and `vllm serve --runner pooling` of a tiny random
sentence-transformers checkpoint (mean pooling, two Dense layers, normalisation) against
transformers on CPU torch, inputs shorter and longer than the sliding layers' bidirectional
window (varlen_attention's window option); inputs over the served length are refused."""

from __future__ import annotations

import numpy as np
import pytest

from pooling_checkpoint import GEMMA_POSITIONS, GEMMA_WINDOW, VOCAB, embeddinggemma_reference, write_embeddinggemma
from pooling_reference import cosine


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_embeddinggemma(tmp_path_factory.mktemp("embeddinggemma"))


def test_packed_encoder_matches_transformers(backend, model_dir):
    """CPU kernels and the emulated Metal kernels (conftest backend; a Mac runs "metal")."""
    import mlx.core as mx
    import torch
    import transformers

    from vllm_metal.models.gemma3_encoder import load_gemma3_encoder

    ours = load_gemma3_encoder(model_dir)
    assert ours.config.windows == [GEMMA_WINDOW, 0, GEMMA_WINDOW]
    assert ours.config.max_tokens == GEMMA_POSITIONS
    ref = transformers.Gemma3TextModel.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    rng = np.random.default_rng(0)
    # past the window: the sliding layers' keys are cut (a window test of the kernels in the
    # emulator: test_varlen_attention.py)
    lengths = (1, 9, GEMMA_WINDOW, 2 * GEMMA_WINDOW + 7, 30) if backend == "native" else (1, 9, 20)
    seqs = [rng.integers(3, VOCAB, n).tolist() for n in lengths]
    cu = np.cumsum([0] + [len(s) for s in seqs]).astype(np.int32)
    got = np.array(ours(mx.array(sum(seqs, [])), cu))
    for i, s in enumerate(seqs):
        with torch.no_grad():
            want = ref(input_ids=torch.tensor([s])).last_hidden_state[0].numpy()
        np.testing.assert_allclose(got[cu[i]:cu[i + 1]], want, atol=1e-4 * max(1.0, np.abs(want).max()))
    with pytest.raises(ValueError, match=f"longer than the model's {GEMMA_POSITIONS} positions"):
        ours(mx.array([3] * (GEMMA_POSITIONS + 1)), [0, GEMMA_POSITIONS + 1])


@pytest.mark.slow
@pytest.mark.serving
def test_served_embeddings_match_sentence_transformers_modules(model_dir):
    from serving_harness import Server

    longest = 3 * GEMMA_WINDOW
    args = ["--runner", "pooling", "--dtype", "float32", "--max-model-len", str(longest),
            "--max-num-seqs", "16"]
    server = Server(str(model_dir), "embeddinggemma", args)
    try:
        rng = np.random.default_rng(1)
        prompts = [rng.integers(3, VOCAB, n).tolist() for n in (1, 6, 40, GEMMA_WINDOW, longest)]
        r = server.client.post("/v1/embeddings", json={"model": server.name, "input": prompts})
        assert r.status_code == 200, r.text
        got = [np.array(d["embedding"]) for d in sorted(r.json()["data"], key=lambda d: d["index"])]
        for p, g in zip(prompts, got):
            assert g.shape == (64,)
            assert cosine(g, embeddinggemma_reference(model_dir, p)) >= 0.9999
        # over --max-model-len: a 4xx, the engine lives
        r = server.client.post("/v1/embeddings", json={"model": server.name,
                                                       "input": [list(range(3, 3 + longest + 5))]})
        assert 400 <= r.status_code < 500, r.text
        assert server.alive()
    finally:
        server.stop()
