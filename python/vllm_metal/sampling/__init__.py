"""Native sampling on MLX arrays (issue 8); see docs/serving.md, "Sampling".

table.py keeps each request's parameters by row; batch.py gathers a step;
processors.py, filters.py, draw.py and logprobs.py are the stages that
sampler.py chains (rows.py runs a stage on the rows that use it);
prompt_logprobs.py collects prompt logprobs over chunks; token_logprobs.py
scores logprob_token_ids and prompt_logprob_token_ids; custom_processors.py runs
--logits-processors (vLLM's V1 interface; custom_processors_v2.py: V2) on torch
copies of a step's logits;
torch_sampler.py runs vLLM's own Sampler on the same logits for comparison.
"""

from vllm_metal.sampling.batch import SamplingBatch, gather_batch
from vllm_metal.sampling.sampler import SampleResult, Sampler
from vllm_metal.sampling.table import SamplingTable

__all__ = ["SampleResult", "Sampler", "SamplingBatch", "SamplingTable", "gather_batch"]
