"""`vllm serve` on a tiny random-weight Qwen3.5 text checkpoint (hybrid: gated delta net
+ attention), token-exact against mlx-lm's own Qwen3.5 forward on the same files.

The servers run with a 32-token step budget (prompts are prefilled in chunks, the
linear-attention state carried across steps) and a pool of 16 blocks shared by the
attention group and the three state groups, so a dozen concurrent requests do not fit
and the scheduler preempts some (their state is recomputed from scratch on resume).
Both runner contracts: V2 (default) and V1 (VLLM_USE_V2_MODEL_RUNNER=0), and both
checkpoint layouts: the V2 server reads the published (vision + language) layout
(Qwen3_5ForConditionalGeneration, served text-only), the V1 server the text-only one
(Qwen3_5ForCausalLM). Same weights, one reference.
"""

from __future__ import annotations

import concurrent.futures as cf
import time

import numpy as np
import pytest

from qwen3_5_checkpoint import greedy, reference_model, write_checkpoint
from serving_harness import Server, runner_hook

pytestmark = [pytest.mark.slow, pytest.mark.serving]

# float32: vLLM's dtype "auto" would serve a float32 checkpoint in half precision
SERVER_ARGS = ["--dtype", "float32", "--max-model-len", "128", "--max-num-seqs", "8",
               "--num-gpu-blocks-override", "16", "--max-num-batched-tokens", "32"]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("qwen3_5"), seed=0)


@pytest.fixture(scope="module")
def reference(checkpoint):
    return reference_model(checkpoint)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    vl = write_checkpoint(tmp_path_factory.mktemp("qwen3_5_vl"), seed=0, vision_language=True)
    s = Server(str(vl), "qwen3_5-tiny", [*SERVER_ARGS, "--enable-prefix-caching"])
    yield s
    s.stop()


def complete_ids(server, prompt: list[int], max_tokens: int) -> list[int]:
    r = server.client.post("/v1/completions", json={
        "model": server.name, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
        "return_token_ids": True, "ignore_eos": True})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["token_ids"]


def jobs(seed: int, n: int) -> list[tuple[list[int], int]]:
    rng = np.random.default_rng(seed)
    return [(rng.integers(3, 320, int(rng.integers(20, 70))).tolist(), int(rng.integers(10, 40)))
            for _ in range(n)]


def preemptions(server) -> float:
    return metric(server, "vllm:num_preemptions_total")


def check_concurrent(server, reference, seed: int) -> None:
    work = jobs(seed, 12)
    want = [greedy(reference, p, n) for p, n in work]
    with cf.ThreadPoolExecutor(len(work)) as pool:
        got = list(pool.map(lambda j: complete_ids(server, *j), work))
    for i, (g, w) in enumerate(zip(got, want)):
        assert g == w, f"request {i} (prompt of {len(work[i][0])} tokens)"


def assert_preempted(server) -> None:
    # How many requests run together depends on how fast the 12 arrive (a loaded machine
    # admits them more slowly), so preemption is required of the test, not of each wave.
    deadline = time.monotonic() + 15  # the metrics are published a little after the step
    while preemptions(server) == 0 and time.monotonic() < deadline:
        time.sleep(0.5)
    assert preemptions(server) > 0, "the small block pool should have forced preemption"


def test_single_request_matches_mlx_lm(server, reference):
    # 67 prompt tokens: prefilled in three chunks of the 32-token budget
    prompt = jobs(7, 1)[0][0] + list(range(40, 60))
    assert complete_ids(server, prompt, 24) == greedy(reference, prompt, 24)
    short = [5, 17, 3, 88, 42, 1, 9, 60, 23, 71, 4]
    tokens = complete_ids(server, short, 12)
    assert tokens == greedy(reference, short, 12)
    assert len(set(tokens)) > 3  # not a degenerate checkpoint


def test_images_are_refused_with_a_400(server):
    r = server.client.post("/v1/chat/completions", json={
        "model": server.name, "max_tokens": 4, "messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}]}]})
    assert r.status_code == 400 and "not a multimodal model" in r.text
    assert server.alive()


def test_concurrent_requests_with_preemption_match_mlx_lm(server, reference):
    check_concurrent(server, reference, seed=1)
    # slots were freed and reused: a second wave gives the reference outputs too
    check_concurrent(server, reference, seed=2)
    assert_preempted(server)


def metric(server, name: str) -> float:
    for line in server.client.get("/metrics").text.splitlines():
        if line.startswith(name):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"no {name} metric")


def prefix_hits(server) -> float:
    time.sleep(1.5)  # the metrics are published a little after the step
    return metric(server, "vllm:prefix_cache_hits_total")


def shared_prefix_jobs(seed: int, n: int) -> list[tuple[list[int], int]]:
    """Prompts that share a 70-token prefix (blocks of 32: two whole blocks), then diverge
    after 0 to 20 more shared tokens."""
    rng = np.random.default_rng(seed)
    shared = rng.integers(3, 320, 90).tolist()
    return [(shared[:70 + int(rng.integers(0, 20))] + rng.integers(3, 320, int(rng.integers(1, 9))).tolist(),
             int(rng.integers(6, 20))) for _ in range(n)]


def test_prefix_caching_is_exact(server, reference):
    """Prefix caching is on (the linear-attention state is checkpointed at block
    boundaries and resumed on a hit): shared-prefix prompts with divergent suffixes give
    mlx-lm's tokens, alone, one after another, as a conversation's next turn, and
    concurrently with preemption, while the cache is hit."""
    before = prefix_hits(server)
    work = shared_prefix_jobs(5, 3)
    for prompt, n in work:
        assert complete_ids(server, prompt, n) == greedy(reference, prompt, n)
    assert prefix_hits(server) >= before + 2 * 64  # the second and third resumed after 64
    # a next turn: the first reply's blocks (decode checkpoints) are hit too
    prompt, n = work[0]
    turn = prompt + greedy(reference, prompt, n) + [11, 12, 13]
    before = prefix_hits(server)
    assert complete_ids(server, turn, 8) == greedy(reference, turn, 8)
    assert prefix_hits(server) >= before + 64
    # many at once, preempting one another, each as if alone
    work = shared_prefix_jobs(6, 12)
    want = [greedy(reference, p, n) for p, n in work]
    with cf.ThreadPoolExecutor(len(work)) as pool:
        got = list(pool.map(lambda j: complete_ids(server, *j), work))
    for i, (g, w) in enumerate(zip(got, want)):
        assert g == w, f"request {i} (prompt of {len(work[i][0])} tokens)"
    assert_preempted(server)


async def _vanish(server, n: int) -> None:
    """n streams dropped after their first chunk, n requests dropped during their chunked
    prefill, at once (8 rows, 16 blocks: most wait in the queue or are preempted)."""
    import asyncio

    import httpx

    rng = np.random.default_rng(9)

    async def after_first_chunk(client):
        async with client.stream("POST", "/v1/completions", json={
                "model": server.name, "prompt": rng.integers(3, 320, 40).tolist(), "max_tokens": 80,
                "ignore_eos": True, "stream": True}) as r:
            async for line in r.aiter_lines():
                if line.startswith("data: "):
                    return  # leaving the block closes the connection

    async def during_prefill(client):
        try:
            await asyncio.wait_for(client.post("/v1/completions", json={
                "model": server.name, "prompt": rng.integers(3, 320, 100).tolist(),
                "max_tokens": 20, "ignore_eos": True}), timeout=0.3)
        except asyncio.TimeoutError:
            pass

    limits = httpx.Limits(max_connections=4 * n, max_keepalive_connections=0)
    async with httpx.AsyncClient(base_url=server.base, timeout=120, limits=limits) as client:
        await asyncio.gather(*(after_first_chunk(client) for _ in range(n)),
                             *(during_prefill(client) for _ in range(n)))


def test_vanished_clients_free_blocks_and_state_slots(server, reference):
    """Clients that vanish mid-stream or mid-prefill (32 at once) are aborted in the engine;
    their blocks and linear-attention state slots come back: the pool drains to empty and
    a full wave afterwards still gives mlx-lm's tokens (a leaked or stale slot would not)."""
    import asyncio

    asyncio.run(_vanish(server, 16))
    deadline = time.monotonic() + 60
    while (metric(server, "vllm:num_requests_running") or metric(server, "vllm:num_requests_waiting")
           or metric(server, "vllm:kv_cache_usage_perc")):
        assert time.monotonic() < deadline, "requests or blocks left after the clients vanished"
        time.sleep(0.25)
    check_concurrent(server, reference, seed=3)


def test_v1_runner_contract_with_preemption(checkpoint, reference):
    s = Server(str(checkpoint), "qwen3_5-tiny", SERVER_ARGS, env={"VLLM_USE_V2_MODEL_RUNNER": "0"})
    try:
        check_concurrent(s, reference, seed=3)
        check_concurrent(s, reference, seed=4)
        assert_preempted(s)
    finally:
        s.stop()


def test_gguf_file_with_mtp_block_is_served(tmp_path, reference):
    # `vllm serve file.gguf`: config and tokenizer from the metadata, the MTP layer ignored
    from qwen3_5_checkpoint import random_model, write_gguf

    gguf = write_gguf(random_model(seed=0), tmp_path / "qwen35-mtp.gguf", mtp=True)
    s = Server(str(gguf), "qwen3_5-gguf", ["--dtype", "float32", "--max-model-len", "128",
                                           "--max-num-seqs", "4", "--num-gpu-blocks-override", "32"],
               env={"XDG_CACHE_HOME": str(tmp_path / "cache")})
    try:
        for prompt, n in jobs(5, 3):
            assert complete_ids(s, prompt, n) == greedy(reference, prompt, n)
        # prefix caching (on by default) resumes the GGUF model's state exactly too
        before = prefix_hits(s)
        for prompt, n in shared_prefix_jobs(8, 3):
            assert complete_ids(s, prompt, n) == greedy(reference, prompt, n)
        assert prefix_hits(s) >= before + 2 * 64
    finally:
        s.stop()



# In the served process: the n-gram proposer's drafts replaced by an oracle's, which
# knows each job's greedy continuation and proposes j right tokens then a wrong one,
# j = 0..3 in turn (3: all right), so drafts are kept, partly kept and rejected.
ORACLE_HOOK = runner_hook(
    """
    import json
    import os


    def wrap(execute_model):
        jobs = json.load(open(os.environ["ORACLE_JOBS"]))

        def oracle(spec, propose):
            def proposing(packer, req_ids, outputs, **kw):
                propose(packer, req_ids, outputs, **kw)
                for r in list(spec.drafts):
                    history = packer.token_ids(r)
                    for prompt, truth in jobs:
                        gen = history[len(prompt):]
                        if history[:len(prompt)] == prompt and gen == truth[:len(gen)]:
                            right = truth[len(gen):]
                            j = len(gen) % 4
                            d = right[:j] + ([(right[j] + 1) % 320] if j < len(right) else [])
                            spec.drafts[r] = d[:spec.num_speculative_tokens]
                            if r not in spec.proposed:
                                spec.proposed.append(r)
            return proposing

        def patched(self, so):
            if self.speculation is not None and not getattr(self, "_oracle", False):
                self.speculation.propose = oracle(self.speculation, self.speculation.propose)
                self._oracle = True
            return execute_model(self, so)

        return patched
    """
)


@pytest.mark.parametrize("scheduling", ["async", "sync"])
def test_speculative_decoding_matches_mlx_lm(tmp_path, reference, scheduling):
    """Drafts on the hybrid model: a rejected draft takes the linear-attention state back
    (its slot restored, the kept tokens replayed in front of the next step), so the tokens
    stay mlx-lm's greedy ones. The drafts come from an oracle (ORACLE_HOOK): a random
    checkpoint never repeats itself, so n-gram drafts would all be rejected."""
    import json
    import os
    import re

    checkpoint = write_checkpoint(tmp_path / "text", seed=0)
    work = jobs(11, 4)
    want = [greedy(reference, p, n) for p, n in work]
    (tmp_path / "jobs.json").write_text(json.dumps([[p, w] for (p, _), w in zip(work, want)]))
    (tmp_path / "sitecustomize.py").write_text(ORACLE_HOOK)
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
            "prompt_lookup_max": 3}
    env = {"ORACLE_JOBS": str(tmp_path / "jobs.json"),
           "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])}
    extra = [] if scheduling == "async" else ["--no-async-scheduling"]
    s = Server(str(checkpoint), "qwen3_5-tiny",
               [*SERVER_ARGS, "--speculative-config", json.dumps(spec), *extra], env=env)
    try:
        with cf.ThreadPoolExecutor(len(work)) as pool:
            got = list(pool.map(lambda j: complete_ids(s, *j), work))
        metrics = s.client.get("/metrics").text
    finally:
        s.stop()
    for i, (g, w) in enumerate(zip(got, want)):
        assert g == w, f"request {i}"

    def total(name):
        return sum(float(v) for v in re.findall(rf"^{name}(?:{{[^}}]*}})? ([0-9.e+]+)$", metrics, re.M))

    drafts = total("vllm:spec_decode_num_draft_tokens_total")
    accepted = total("vllm:spec_decode_num_accepted_tokens_total")
    assert 0.2 * drafts < accepted < drafts, (accepted, drafts)  # kept, and rejected


def test_a_draft_model_on_the_hybrid_model_gives_mlx_lm_greedy_tokens(tmp_path, reference):
    """A random draft model (a tiny llama with the same vocabulary) drafts every step and
    nearly every draft is rejected: each rejection restores the linear-attention state
    saved where the drafts began, so the replay stays under k tokens however many
    rejections follow (it once grew until the packer's step budget overflowed)."""
    import json
    import re

    from vllm_metal.models.testing import tiny_config, write_random_checkpoint

    draft = write_random_checkpoint(tiny_config("llama", vocab_size=320), tmp_path / "draft", seed=5)
    work = jobs(12, 4)
    want = [greedy(reference, p, n) for p, n in work]
    spec = {"method": "draft_model", "model": str(draft), "num_speculative_tokens": 3}
    s = Server(str(write_checkpoint(tmp_path / "text", seed=0)), "qwen3_5-tiny",
               [*SERVER_ARGS, "--speculative-config", json.dumps(spec)])
    try:
        with cf.ThreadPoolExecutor(len(work)) as pool:
            got = list(pool.map(lambda j: complete_ids(s, *j), work))
        metrics = s.client.get("/metrics").text
    finally:
        s.stop()
    for i, (g, w) in enumerate(zip(got, want)):
        assert g == w, f"request {i}"
    drafts = draft_tokens(metrics)
    assert drafts >= 3 * 20, drafts  # drafted on most steps


MTP_LOG_HOOK = runner_hook(
    """
    import json
    import os


    def wrap(execute_model):
        def logging(spec, propose):
            def proposing(packer, req_ids, outputs, **kw):
                propose(packer, req_ids, outputs, **kw)
                with open(os.environ["MTP_LOG"], "a") as f:
                    for r, d in spec.drafts.items():
                        f.write(json.dumps([list(packer.token_ids(r)), list(d)]) + "\\n")
            return proposing

        def patched(self, so):
            if self.speculation is not None and not getattr(self, "_logged", False):
                self.speculation.propose = logging(self.speculation, self.speculation.propose)
                self._logged = True
            return execute_model(self, so)

        return patched
    """
)


@pytest.mark.parametrize("scheduling", ["async", "sync"])
def test_mtp_speculation_gives_mlx_lm_greedy_tokens(tmp_path, reference, scheduling):
    """`--speculative-config '{"method": "mtp"}'` on a checkpoint with a (random) MTP
    block: concurrent requests (chunked prefills, rejections) give mlx-lm's greedy tokens,
    and the served drafts are the block's: a chain of mlx-lm's modules over each
    request's whole history proposes the same tokens, so the block's cache held every
    position right (a misplaced row would change them)."""
    import json
    import os
    import re

    import mlx.core as mx
    from test_mtp import _reference_chain

    ckpt = write_checkpoint(tmp_path / "text", seed=0, mtp=True)
    work = jobs(13, 4)
    want = [greedy(reference, p, n) for p, n in work]
    (tmp_path / "sitecustomize.py").write_text(MTP_LOG_HOOK)
    log = tmp_path / "drafts.jsonl"
    env = {"MTP_LOG": str(log),
           "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])}
    spec = {"method": "mtp", "num_speculative_tokens": 2}
    extra = [] if scheduling == "async" else ["--no-async-scheduling"]
    s = Server(str(ckpt), "qwen3_5-tiny",
               [*SERVER_ARGS, "--speculative-config", json.dumps(spec), *extra], env=env)
    try:
        with cf.ThreadPoolExecutor(len(work)) as pool:
            got = list(pool.map(lambda j: complete_ids(s, *j), work))
        metrics = s.client.get("/metrics").text
    finally:
        s.stop()
    for i, (g, w) in enumerate(zip(got, want)):
        assert g == w, f"request {i}"
    drafts = draft_tokens(metrics)
    assert drafts >= 2 * 20, drafts
    records = [json.loads(line) for line in log.read_text().splitlines()][::3]
    assert len(records) >= 10
    same = 0
    for history, served in records:
        hidden = reference.model(mx.array(history[:-1])[None])[0]
        same += served == _reference_chain(ckpt, reference, history, hidden, len(served))[:len(served)]
    assert same >= 0.9 * len(records), (same, len(records))  # float32 near-ties aside


def test_mtp_speculation_from_a_gguf_file(tmp_path, reference):
    """`vllm serve file.gguf --speculative-config '{"method": "mtp"}'`: the MTP block
    llama.cpp stores as an extra layer drafts; the tokens stay mlx-lm's greedy ones."""
    import json

    from qwen3_5_checkpoint import random_model, write_gguf

    gguf = write_gguf(random_model(seed=0), tmp_path / "qwen35-mtp.gguf", mtp=True)
    spec = {"method": "mtp", "num_speculative_tokens": 2}
    s = Server(str(gguf), "qwen3_5-gguf", [*SERVER_ARGS, "--speculative-config", json.dumps(spec)],
               env={"XDG_CACHE_HOME": str(tmp_path / "cache")})
    try:
        work = jobs(14, 3)
        with cf.ThreadPoolExecutor(len(work)) as pool:
            got = list(pool.map(lambda j: complete_ids(s, *j), work))
        metrics = s.client.get("/metrics").text
    finally:
        s.stop()
    assert got == [greedy(reference, p, n) for p, n in work]
    assert draft_tokens(metrics) >= 2 * 15


def draft_tokens(metrics: str) -> float:
    """vllm:spec_decode_num_draft_tokens_total from a /metrics text."""
    import re

    return sum(float(v) for v in re.findall(
        r"^vllm:spec_decode_num_draft_tokens_total(?:{[^}]*})? ([0-9.e+]+)$", metrics, re.M))
