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

# The sampler adds logit_bias in float32, then divides by the temperature (down to vLLM's
# 1e-5, below which a request is greedy): a bias past 1e30 can reach infinity there, and NaN
# or +inf on a logit make the row's softmax NaN (docs/reliability.md). vLLM's HTTP front end
# clamps biases to [-100, 100]; the offline API passes them as given.
MAX_LOGIT_BIAS = 1e30


def unsupported_sampling_parameters(params) -> list[tuple[str, str]]:
    """(parameter, why) for every setting the runner cannot honour."""
    problems = []
    bad_bias = [(t, b) for t, b in (params.logit_bias or {}).items()
                if not (math.isfinite(b) and abs(b) <= MAX_LOGIT_BIAS)]
    if bad_bias:
        t, b = bad_bias[0]
        problems.append(("logit_bias", f"logit_bias values must be finite numbers of magnitude at "
                                       f"most {MAX_LOGIT_BIAS:g}, got {b} for token {t} "
                                       f"({len(bad_bias)} such value(s))"))
    return problems


def validate_sampling_params(params) -> None:
    # from the defining modules: `from vllm import ...` runs vllm/__init__'s lazy
    # __getattr__ (an import_module call) on every request, ~16 us each (4 ms a batch of 256)
    from vllm.exceptions import VLLMValidationError
    from vllm.pooling_params import PoolingParams
    from vllm.sampling_params import SamplingParams

    if isinstance(params, PoolingParams):
        validate_pooling_params(params)
        return
    if not isinstance(params, SamplingParams):
        raise VLLMValidationError("[vllm-metal] only generation and pooling requests are supported")
    problems = unsupported_sampling_parameters(params)
    if problems:
        raise VLLMValidationError(
            "[vllm-metal] " + "; ".join(why for _, why in problems), parameter=problems[0][0])


def validate_pooling_params(params) -> None:
    """What the pooling runner (pooling.py) does not do: late-interaction scoring (query
    token embeddings cached in the worker) and step pooling."""
    from vllm.exceptions import VLLMValidationError

    if params.late_interaction_params is not None:
        raise VLLMValidationError("[vllm-metal] late-interaction scoring is not supported",
                                  parameter="late_interaction_params")
    if params.step_tag_id is not None or params.returned_token_ids is not None:
        raise VLLMValidationError("[vllm-metal] step pooling is not supported", parameter="step_tag_id")
