"""Per-request checks run in vLLM's front end (Platform.validate_request).

An unsupported parameter is a 400 naming it, never silently ignored. The
native sampler (sampling/) honours temperature, top-k/p, min-p, penalties,
logit_bias, min_tokens, allowed_token_ids, bad_words, seeds, logprobs and
prompt logprobs (top n or chosen token ids), the grammars of structured
outputs (model_runner.py) and thinking_token_budget (sampling/thinking_budget.py);
--logits-processors run in sampling/custom_processors.py (vLLM 0.33's SamplingParams
has no per-request logits_processors: its HTTP front end drops such a field with a
warning). n > 1 is fanned out into separate requests by vLLM's front end. What is
left is refused.
"""

from __future__ import annotations

import math

# The sampler adds logit_bias in float32: a larger magnitude is an infinity there, and
# NaN or +inf on a logit make the row's softmax NaN (docs/reliability.md).
FLOAT32_MAX = 3.4028234663852886e38


def unsupported_sampling_parameters(params) -> list[tuple[str, str]]:
    """(parameter, why) for every setting the runner cannot honour."""
    problems = []
    bad_bias = [(t, b) for t, b in (params.logit_bias or {}).items()
                if not (math.isfinite(b) and abs(b) < FLOAT32_MAX)]
    if bad_bias:
        t, b = bad_bias[0]
        problems.append(("logit_bias", f"logit_bias values must be finite float32 numbers, got {b} "
                                       f"for token {t} ({len(bad_bias)} such value(s))"))
    return problems


def validate_sampling_params(params) -> None:
    from vllm import SamplingParams
    from vllm.exceptions import VLLMValidationError

    if not isinstance(params, SamplingParams):
        raise VLLMValidationError("[vllm-metal] only text generation requests are supported")
    problems = unsupported_sampling_parameters(params)
    if problems:
        raise VLLMValidationError(
            "[vllm-metal] " + "; ".join(why for _, why in problems), parameter=problems[0][0])
