"""`vllm serve file.gguf --runner pooling` of decoder embedding files: the pooling the
file's `<arch>.pooling_type` names (MEAN on a qwen3 file, LAST on a llama one), normalised,
against transformers on CPU torch on the same (F32) weights; a RANK file is refused."""

from __future__ import annotations

import numpy as np
import pytest

from pooling_reference import cosine, embedding
from serving_harness import Server

pytestmark = [pytest.mark.slow, pytest.mark.serving]

ARGS = ["--runner", "pooling", "--max-model-len", "256", "--max-num-seqs", "16",
        "--max-num-batched-tokens", "256", "--kv-cache-memory-bytes", str(32 << 20)]


def _files(tmp_path, name: str, pooling: str):
    from vllm_metal.models.testing import tiny_config, write_dense_checkpoint, write_tiny_gguf

    config = tiny_config(name)
    path = tmp_path / f"{name}-{pooling}.gguf"
    dense = write_tiny_gguf(config, path, seed=3, qtype="F32", pooling_type=pooling)
    return path, write_dense_checkpoint(config, dense, tmp_path / f"{name}-dense")


@pytest.mark.parametrize("name, pooling", [("qwen3", "MEAN"), ("llama", "LAST")])
def test_served_gguf_embeddings_match_transformers(tmp_path, name, pooling):
    path, dense_dir = _files(tmp_path, name, pooling)
    server = Server(str(path), "gguf-embed", ARGS)
    try:
        rng = np.random.default_rng(5)
        prompts = [rng.integers(3, 300, n).tolist() for n in (1, 7, 33, 100, 150)]
        r = server.client.post("/v1/embeddings", json={"model": server.name, "input": prompts})
        assert r.status_code == 200, r.text
        got = [np.array(d["embedding"]) for d in sorted(r.json()["data"], key=lambda d: d["index"])]
        for p, g in zip(prompts, got):
            want = embedding(dense_dir, p, pooling)
            assert g.shape == want.shape
            assert cosine(g, want) >= 0.9999
            assert abs(np.linalg.norm(g) - 1.0) < 1e-4  # normalised, as llama.cpp's server does
        # the other pooling gives other vectors: the file's metadata was what chose it
        other = "LAST" if pooling == "MEAN" else "MEAN"
        assert cosine(got[3], embedding(dense_dir, prompts[3], other)) < 0.99
    finally:
        server.stop()
