"""--enable-prompt-embeds is refused at startup, naming the flag.

The runner feeds token ids only. Without the refusal, a request with prompt_embeds
(verified with `vllm serve` of SmolLM2 on the CPU) was answered from the scheduler's
placeholder ids (all 0) under the default V2 runner contract, a wrong answer with a 200,
and killed the engine under VLLM_USE_V2_MODEL_RUNNER=0 (ValueError in execute_model).
"""

from __future__ import annotations

import pytest

from test_refused_output_options import config
from vllm_metal.platform import UnsupportedConfiguration, _refuse_unsupported


def test_prompt_embeds_are_refused_by_the_config_check():
    _refuse_unsupported(config())  # the same config without the flag is accepted
    with pytest.raises(UnsupportedConfiguration,
                       match=r"--enable-prompt-embeds \(prompt embeddings as input\) is not supported"):
        _refuse_unsupported(config(enable_prompt_embeds=True))


@pytest.mark.slow
@pytest.mark.serving
def test_vllm_serve_refuses_to_start_with_prompt_embeds():
    from serving_harness import Server
    from vllm_metal.models.offline import OFFLINE_GGUF

    with pytest.raises(RuntimeError, match=r"vllm serve exited") as failure:
        Server(str(OFFLINE_GGUF["smollm2"]()), "smollm2",
               ["--max-model-len", "256", "--num-gpu-blocks-override", "32", "--enable-prompt-embeds"],
               startup_timeout=300)
    assert "--enable-prompt-embeds (prompt embeddings as input) is not supported" in str(failure.value)
