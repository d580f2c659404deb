"""Speculative decoding (n-gram, and a draft model) through `vllm serve` on the offline
SmolLM2 model.

The reference is the same model served without speculation: greedy requests, alone
and concurrent (in a KV pool they overflow: preemption with drafts in flight), with penalties, min_tokens, stop strings and EOS, give the same text
and finish reasons; logprobs of the kept tokens are the reference's. Both servers run
batch-invariant (VLLM_BATCH_INVARIANT=1): a step with drafts scores several tokens of
a request at once, and only that mode promises the same logits as one token at a time.
Under async scheduling (vLLM's default); the greedy and structured tests also sync. vLLM's spec-decode counters appear
on /metrics. Random sampling's rule is tested against the target distribution in
test_speculative_verify.py; here seeded requests are reproducible.
"""

from __future__ import annotations

import concurrent.futures as cf
import json
import re
import time
from types import SimpleNamespace

import pytest

from serving_harness import Server
from test_serving import smollm2_gguf

SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2,
        "prompt_lookup_max": 4}
# a pool of 24 blocks (384 tokens) that the concurrent tests overflow: requests are
# preempted with drafts in flight and recomputed
COMMON = ["--max-model-len", "256", "--max-num-seqs", "8", "--num-gpu-blocks-override", "24"]
ENV = {"VLLM_BATCH_INVARIANT": "1"}
# 6 such requests need ~48 blocks together, twice the pool: preemption happens even
# when a loaded machine staggers their arrival (48 tokens each overflowed it by 1 block)
OVERFLOWING = dict(max_tokens=96)

# prompts whose continuations repeat what they contain (drafts get accepted), and one
# free-text prompt
PROMPTS = [
    "Copy the list exactly.\nList: apple, banana, cherry, apple, banana, cherry, apple, banana,",
    "def add(a, b):\n    return a + b\n\ndef add3(a, b, c):\n    return a + b + c\n\ndef add4(a, b, c, d):\n",
    "1, 2, 3, 1, 2, 3, 1, 2, 3, 1, 2,",
    "The cat sat on the mat. The cat sat on the mat. The cat sat on",
    "Once upon a time, in a small village by the sea,",
    "Monday, Tuesday, Wednesday, Thursday, Friday, Saturday, Sunday, Monday, Tuesday,",
]


@pytest.fixture(scope="module")
def reference():
    s = Server(smollm2_gguf(), "smollm2", COMMON, env=ENV)
    yield s
    s.stop()


def _speculative_server(extra: list[str]) -> Server:
    return Server(smollm2_gguf(), "smollm2", COMMON + ["--speculative-config", json.dumps(SPEC)] + extra,
                  env=ENV)


@pytest.fixture(scope="module")
def speculative():
    """Async scheduling (vLLM's default): every test."""
    s = _speculative_server([])
    yield s
    s.stop()


@pytest.fixture(scope="module")
def speculative_sync():
    """Sync scheduling (the engine takes the drafts with take_draft_token_ids): the
    greedy and structured tests."""
    s = _speculative_server(["--no-async-scheduling"])
    yield s
    s.stop()


@pytest.fixture(params=["async", "sync"])
def any_speculative(request):
    return request.getfixturevalue("speculative" if request.param == "async" else "speculative_sync")


def _complete(server, prompt, **kw) -> dict:
    r = server.complete(prompt, **{"max_tokens": 48, **kw})
    assert r["status"] == 200, r
    return r["choices"][0]


def _all(server, prompts, **kw) -> list[dict]:
    with cf.ThreadPoolExecutor(len(prompts)) as pool:
        return list(pool.map(lambda p: _complete(server, p, **kw), prompts))


def _counter(server, name: str) -> float:
    text = server.client.get("/metrics").text
    values = [float(m.group(1)) for m in re.finditer(rf"^{name}(?:{{[^}}]*}})? ([0-9.e+]+)$", text, re.M)]
    return sum(values)


@pytest.mark.slow
@pytest.mark.serving
def test_greedy_output_is_the_same_with_and_without_speculation(reference, any_speculative):
    speculative = any_speculative
    drafts_before = _counter(speculative, "vllm:spec_decode_num_draft_tokens_total")
    proposals_before = _counter(speculative, "vllm:spec_decode_num_drafts_total")
    accepted_before = _counter(speculative, "vllm:spec_decode_num_accepted_tokens_total")
    preempted_before = _counter(speculative, "vllm:num_preemptions_total")
    want = _all(reference, PROMPTS, **OVERFLOWING)
    got = _all(speculative, PROMPTS, **OVERFLOWING)  # concurrent: drafting requests preempted
    for p, w, g in zip(PROMPTS, want, got):
        assert (g["text"], g["finish_reason"]) == (w["text"], w["finish_reason"]), p
    alone = _complete(speculative, PROMPTS[0], **OVERFLOWING)
    assert alone["text"] == want[0]["text"]
    drafts = _counter(speculative, "vllm:spec_decode_num_draft_tokens_total") - drafts_before
    accepted = _counter(speculative, "vllm:spec_decode_num_accepted_tokens_total") - accepted_before
    assert drafts > 0 and 0 < accepted <= drafts, (drafts, accepted)
    proposals = _counter(speculative, "vllm:spec_decode_num_drafts_total") - proposals_before
    assert 0 < proposals <= drafts, (proposals, drafts)  # a draft holds one token or more
    assert _counter(speculative, "vllm:spec_decode_num_accepted_tokens_per_pos_total") > 0
    assert _counter(speculative, "vllm:num_preemptions_total") > preempted_before


@pytest.mark.slow
@pytest.mark.serving
@pytest.mark.parametrize("kw", [
    dict(frequency_penalty=0.4, presence_penalty=0.2, repetition_penalty=1.1),
    dict(min_tokens=40, max_tokens=44),
    dict(stop=[" cherry", "\n\n", " mat"]),
    dict(max_tokens=200),  # long enough to end by EOS on some prompts
    dict(allowed_token_ids=list(range(300, 2000)), max_tokens=24),
], ids=["penalties", "min_tokens", "stop_strings", "eos", "allowed_token_ids"])
def test_sampling_parameters_hold_with_speculation(reference, speculative, kw):
    want = _all(reference, PROMPTS, **kw)
    got = _all(speculative, PROMPTS, **kw)
    for p, w, g in zip(PROMPTS, want, got):
        assert (g["text"], g["finish_reason"]) == (w["text"], w["finish_reason"]), (p, kw)
    if "max_tokens" in kw and kw["max_tokens"] == 200:
        assert any(w["finish_reason"] == "stop" for w in want)


@pytest.mark.slow
@pytest.mark.serving
def test_logprobs_of_kept_tokens(reference, speculative):
    w = _complete(reference, PROMPTS[2], logprobs=3)["logprobs"]
    g = _complete(speculative, PROMPTS[2], logprobs=3)["logprobs"]
    assert g["tokens"] == w["tokens"]
    for a, b in zip(g["token_logprobs"], w["token_logprobs"]):
        assert abs(a - b) < 1e-4, (a, b)
    for a, b in zip(g["top_logprobs"], w["top_logprobs"]):
        assert a.keys() == b.keys()
    # prompt logprobs: their rows come after the draft rows of the step, here those of a
    # request decoding alongside
    w = _complete(reference, PROMPTS[1], prompt_logprobs=1, max_tokens=8)
    with cf.ThreadPoolExecutor(2) as pool:
        busy = pool.submit(_complete, speculative, PROMPTS[2], max_tokens=150)
        time.sleep(1.0)
        g = _complete(speculative, PROMPTS[1], prompt_logprobs=1, max_tokens=8)
        busy.result()
    assert g["prompt_logprobs"] == w["prompt_logprobs"] and g["prompt_logprobs"][1]


@pytest.mark.slow
@pytest.mark.serving
def test_seeded_random_requests_are_reproducible(speculative):
    kw = dict(temperature=0.9, top_p=0.95, seed=1234, max_tokens=40)
    first = _complete(speculative, PROMPTS[3], **kw)["text"]
    batch = _all(speculative, [PROMPTS[3], *PROMPTS[:4]], **kw)
    assert batch[0]["text"] == first
    others = {_complete(speculative, PROMPTS[3], **{**kw, "seed": s})["text"] for s in (99, 100)}
    assert others != {first}  # the seed matters (40 tokens at T=0.9: never all equal)


@pytest.mark.slow
@pytest.mark.serving
def test_vllm_refuses_min_p_and_logit_bias_with_speculation_and_the_engine_lives(speculative):
    # vLLM's front end (SamplingParams._validate_spec_decode) answers these before the
    # plugin sees them; the verification itself handles both (test_speculative_verify.py)
    for kw in (dict(min_p=0.1, temperature=1.0), dict(logit_bias={"11": 2.0})):
        r = speculative.complete(PROMPTS[0], **kw)
        assert r["status"] == 400 and "speculative decoding" in r["error"]["message"], r
    assert _complete(speculative, PROMPTS[0], max_tokens=4)["text"]


def _config(method="ngram", processors=None, model_type="llama"):
    from vllm_metal.speculative import unsupported_reason

    text = SimpleNamespace(model_type=model_type)
    cfg = SimpleNamespace(speculative_config=SimpleNamespace(method=method),
                          model_config=SimpleNamespace(logits_processors=processors,
                                                       hf_text_config=text))
    return unsupported_reason(cfg)


def test_unsupported_speculative_configurations_are_named():
    assert _config() is None
    assert _config("eagle3") is None
    assert "llama-family" in _config("eagle3", model_type="gemma3_text")
    assert _config("draft_model") is None
    assert "Qwen3.5 targets only" in _config("mtp")
    assert "'suffix' is not supported yet" in _config("suffix")
    assert "--logits-processors" in _config(processors=["x.Y"])


@pytest.mark.slow
@pytest.mark.serving
def test_structured_outputs_with_speculation(reference, any_speculative):
    speculative = any_speculative
    # the grammar's mask covers every draft position: a draft it forbids is never kept
    schema = {"type": "object", "properties": {"fruits": {"type": "array", "items": {
        "type": "string", "enum": ["apple", "banana", "cherry"]}, "maxItems": 6}},
        "required": ["fruits"], "additionalProperties": False}
    kw = dict(max_tokens=80, structured_outputs={"json": schema})
    prompts = [PROMPTS[0], PROMPTS[3], "List fruits as JSON: {\"fruits\": [\"apple\", \"apple\","]
    want = _all(reference, prompts, **kw)
    got = _all(speculative, prompts, **kw)
    for p, w, g in zip(prompts, want, got):
        assert (g["text"], g["finish_reason"]) == (w["text"], w["finish_reason"]), p
        json.loads(g["text"])


# ---- a draft model (method "draft_model", draft_model.py) ----------------------------

def _draft_server(draft_dir: str, extra: list[str], common: list[str] = COMMON) -> Server:
    spec = {"method": "draft_model", "model": draft_dir, "num_speculative_tokens": 3}
    return Server(smollm2_gguf(), "smollm2", common + ["--speculative-config", json.dumps(spec)] + extra,
                  env=ENV)


@pytest.fixture(scope="module")
def self_draft():
    """SmolLM2 drafting for itself (the .gguf file named as the draft), async scheduling: with
    batch-invariant logits every draft is the target's own greedy token, so all must be
    kept: a draft cache missing or misplacing a token would show as a rejection."""
    s = _draft_server(smollm2_gguf(), [])
    yield s
    s.stop()


@pytest.fixture(scope="module")
def random_draft(tmp_path_factory):
    """A tiny random-weight Llama with SmolLM2's vocabulary as the draft (mostly wrong:
    drafts rejected at every position), sync scheduling."""
    from vllm_metal.models.testing import tiny_config, write_random_checkpoint

    draft = write_random_checkpoint(tiny_config("llama", vocab_size=49152, max_position_embeddings=8192),
                                    tmp_path_factory.mktemp("draft"), seed=3)
    s = _draft_server(str(draft), ["--no-async-scheduling"])
    yield s
    s.stop()


@pytest.mark.slow
@pytest.mark.serving
def test_a_self_drafting_model_keeps_every_draft_and_the_reference_output(reference, self_draft):
    drafts_before = _counter(self_draft, "vllm:spec_decode_num_draft_tokens_total")
    accepted_before = _counter(self_draft, "vllm:spec_decode_num_accepted_tokens_total")
    preempted_before = _counter(self_draft, "vllm:num_preemptions_total")
    want = _all(reference, PROMPTS, **OVERFLOWING)
    got = _all(self_draft, PROMPTS, **OVERFLOWING)  # concurrent, overflowing the pool: preempted with drafts
    for p, w, g in zip(PROMPTS, want, got):
        assert (g["text"], g["finish_reason"]) == (w["text"], w["finish_reason"]), p
    drafts = _counter(self_draft, "vllm:spec_decode_num_draft_tokens_total") - drafts_before
    accepted = _counter(self_draft, "vllm:spec_decode_num_accepted_tokens_total") - accepted_before
    assert drafts > 0 and accepted == drafts, (drafts, accepted)
    assert _counter(self_draft, "vllm:num_preemptions_total") > preempted_before
    # sampling parameters hold: penalties change the target's choice, drafts follow it
    kw = dict(frequency_penalty=0.4, presence_penalty=0.2, repetition_penalty=1.1)
    want = _all(reference, PROMPTS[:3], **kw)
    got = _all(self_draft, PROMPTS[:3], **kw)
    assert [g["text"] for g in got] == [w["text"] for w in want]


@pytest.mark.slow
@pytest.mark.serving
def test_a_wrong_draft_model_changes_nothing(reference, random_draft):
    drafts_before = _counter(random_draft, "vllm:spec_decode_num_draft_tokens_total")
    want = _all(reference, PROMPTS)
    got = _all(random_draft, PROMPTS)
    for p, w, g in zip(PROMPTS, want, got):
        assert (g["text"], g["finish_reason"]) == (w["text"], w["finish_reason"]), p
    assert _counter(random_draft, "vllm:spec_decode_num_draft_tokens_total") > drafts_before


@pytest.mark.slow
@pytest.mark.serving
def test_the_draft_cache_comes_out_of_the_same_budget(tmp_path):
    """--kv-cache-memory-bytes covers the target's blocks and the draft's together."""
    from vllm_metal.models import prepare_gguf_dir

    budget = 64 << 20
    s = _draft_server(prepare_gguf_dir(smollm2_gguf()), ["--kv-cache-memory-bytes", str(budget)],
                      common=COMMON[:4])  # no block-count override
    try:
        assert _complete(s, PROMPTS[0], max_tokens=4)["text"]
        log = open(s.log_path).read()
    finally:
        s.stop()
    m = re.search(r"KV cache +(\d+) blocks of 16 tokens \(\d+ tokens, ([0-9.]+) MiB\); draft model: "
                  r"(\d+) blocks of 16 tokens \(\d+ tokens, ([0-9.]+) MiB\)", log)
    assert m, log[-3000:]
    assert m.group(1) == m.group(3)  # one block count: the draft is indexed by the target's ids
    total = (float(m.group(2)) + float(m.group(4))) * 2**20
    assert 0.9 * budget < total <= budget, (total, budget)


@pytest.fixture(scope="module")
def eagle3_head(tmp_path_factory):
    """A random EAGLE3 head for SmolLM2 (speculators format, a 2,000-token draft
    vocabulary mapped into SmolLM2's by d2t): its drafts are mostly rejected."""
    from vllm_metal.models.testing import write_random_eagle3_head

    head, *_ = write_random_eagle3_head(tmp_path_factory.mktemp("eagle3"), 576, 49152,
                                        draft_vocab=2000, heads=9, kv=3)
    return head


@pytest.mark.slow
@pytest.mark.serving
def test_an_eagle3_head_changes_nothing(reference, eagle3_head):
    """`--speculative-config '{"method": "eagle3", "model": head}'`: the head reads
    SmolLM2's inner hidden states (layers 2, 15, 27 of 30) and drafts; the text stays the
    reference's, concurrent and preempted."""
    spec = {"method": "eagle3", "model": str(eagle3_head), "num_speculative_tokens": 3}
    s = Server(smollm2_gguf(), "smollm2", COMMON + ["--speculative-config", json.dumps(spec)],
               env=ENV)
    try:
        want = _all(reference, PROMPTS)
        got = _all(s, PROMPTS)
        drafts = _counter(s, "vllm:spec_decode_num_draft_tokens_total")
    finally:
        s.stop()
    for p, w, g in zip(PROMPTS, want, got):
        assert (g["text"], g["finish_reason"]) == (w["text"], w["finish_reason"]), p
    assert drafts >= 3 * 40, drafts
