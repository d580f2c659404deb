"""LoRA adapters (issue 24): PEFT adapters applied per request on the q/k/v/o and
gate/up/down projections (MoE experts too) through ops.lora_apply, many adapters in one batch.

- adapter.py: reads a PEFT adapter directory into per-module (A, B, scale), checked
  against the model (rank, target modules, shapes);
- gguf_adapter.py: the same from a llama.cpp GGUF LoRA file (llama q/k rows un-permuted);
- layers.py: LoraLinear, the wrapper around a base projection, and the slot buffers;
- experts.py: adapters on a sparse-MoE layer's routed experts (per-expert slot buffers, the
  per-op path of a step with adapters, every expert weight form, streamed experts too);
- manager.py: the worker-side LoRA manager (vLLM's add/remove/pin/list_loras), the CPU
  LRU of parsed adapters (--max-cpu-loras), the slots (--max-loras) and each step's
  row -> slot mapping;
- http_status.py: a refused adapter at /v1/load_lora_adapter answers 400 (vLLM: 500).
"""
