"""LoRA with speculative decoding through `vllm serve`: ngram drafts, a draft model (the
base drafting for itself) and an EAGLE3 head. The verify steps pack a sequence's drafts as
extra rows and each row gets its sequence's adapter, so every request's greedy tokens equal
those of the base with its adapter merged in NumPy (W + scale * B @ A), run without LoRA,
whether its drafts are accepted or not; a batch mixes two adapters and the base. (A draft
model or head drafts without the adapter: only how many drafts are kept depends on it.)"""

from __future__ import annotations

import concurrent.futures
import json

import pytest

from lora_checkpoint import merged_greedy, write_two_adapters
from serving_harness import Server
from test_serving_emulated import tiny_attention_checkpoint

pytestmark = [pytest.mark.serving, pytest.mark.slow]

LAYERS = 2
# repeated n-grams: the ngram proposer drafts from the prompt
PROMPTS = {"base": [5, 9, 30, 5, 9, 30, 5, 9], "a1": [3, 8, 200, 3, 8, 200, 3, 8],
           "a2": [17, 56, 90, 17, 56, 90, 17, 56]}
MAX_TOKENS = 12
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2,
         "prompt_lookup_max": 3}


def speculative_config(method: str, base, tmp_path) -> dict:
    if method == "ngram":
        return NGRAM
    if method == "draft_model":  # the base checkpoint drafts for itself (and for the adapters)
        return {"method": "draft_model", "model": str(base), "num_speculative_tokens": 3}
    from vllm_metal.models.testing import write_random_eagle3_head

    cfg = json.loads((base / "config.json").read_text())
    head, *_ = write_random_eagle3_head(tmp_path / "eagle3", cfg["hidden_size"], cfg["vocab_size"],
                                        heads=2, kv=1, draft_vocab=64, aux=[0, 1, 2])
    return {"method": "eagle3", "model": str(head), "num_speculative_tokens": 3}


@pytest.mark.parametrize("method", ["ngram", "draft_model", "eagle3"])
def test_each_request_equals_its_merged_checkpoint_with_drafts(tmp_path, method):
    base = tiny_attention_checkpoint("llama", tmp_path / "base")
    want = merged_greedy(base, tmp_path, write_two_adapters(tmp_path, base, LAYERS), PROMPTS, MAX_TOKENS)
    server = Server(str(base), "llama-tiny", [
        "--dtype", "float32", "--max-model-len", "128", "--max-num-seqs", "4",
        "--num-gpu-blocks-override", "64", "--enable-lora", "--max-loras", "2",
        "--max-lora-rank", "8", "--lora-modules", f"a1={tmp_path / 'a1'}", f"a2={tmp_path / 'a2'}",
        "--speculative-config", json.dumps(speculative_config(method, base, tmp_path))])
    try:
        def run(name):
            r = server.client.post("/v1/completions", json={
                "model": "llama-tiny" if name == "base" else name, "prompt": PROMPTS[name],
                "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True,
                "return_token_ids": True})
            assert r.status_code == 200, r.text
            return r.json()["choices"][0]["token_ids"]

        for name in PROMPTS:  # alone
            assert run(name) == want[name], name
        with concurrent.futures.ThreadPoolExecutor(len(PROMPTS)) as pool:  # one batch
            got = dict(zip(PROMPTS, pool.map(run, PROMPTS)))
        assert got == want
        metrics = server.client.get("/metrics").text
        drafted = [l for l in metrics.splitlines()
                   if l.startswith("vllm:spec_decode_num_draft_tokens_total")]
        assert drafted and float(drafted[0].split()[-1]) > 0, drafted  # drafts were verified
    finally:
        server.stop()
