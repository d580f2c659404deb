"""Per-request checks run in vLLM's front end (Platform.validate_request).

An unsupported parameter is a 400 naming it, never silently ignored.
Until native sampling lands (issue 8) only greedy decoding is served.
"""

from __future__ import annotations


def unsupported_sampling_parameters(params) -> list[tuple[str, str]]:
    """(parameter, why) for every setting the runner cannot honour."""
    problems = []
    greedy = params.temperature is not None and params.temperature < 1e-5
    if not greedy and getattr(params, "top_k", 0) != 1:
        problems.append(("temperature", f"temperature={params.temperature}: only greedy decoding "
                                        "(temperature=0) is supported for now"))
    if params.n != 1:
        problems.append(("n", f"n={params.n}: only n=1 is supported"))
    if params.logprobs is not None:
        problems.append(("logprobs", "logprobs are not supported yet"))
    if params.prompt_logprobs is not None:
        problems.append(("prompt_logprobs", "prompt_logprobs are not supported yet"))
    for name, neutral in (("presence_penalty", 0.0), ("frequency_penalty", 0.0),
                          ("repetition_penalty", 1.0)):
        value = getattr(params, name, neutral)
        if value is not None and value != neutral:
            problems.append((name, f"{name}={value} is not supported yet"))
    if params.logit_bias:
        problems.append(("logit_bias", "logit_bias is not supported yet"))
    if getattr(params, "structured_outputs", None) is not None:
        problems.append(("response_format", "structured outputs are not supported yet"))
    if getattr(params, "allowed_token_ids", None):
        problems.append(("allowed_token_ids", "allowed_token_ids is not supported yet"))
    if getattr(params, "bad_words", None):
        problems.append(("bad_words", "bad_words is not supported yet"))
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
