"""The async output of a step (model_runner._AsyncStepOutput) read on another thread, as
vLLM's multiprocessing executor does on its output rank (the WorkerAsyncOutputCopy
thread): what reading it builds in MLX must be evaluable by the worker's thread, whose
next step uses it. MLX streams belong to the thread that made them, so built on the
output thread's own stream the next step failed ("There is no Stream(cpu, 1) in current
thread": a served TP=2 Qwen3.5-MoE whose n-gram drafts were rejected)."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import mlx.core as mx

from vllm_metal.model_runner import _AsyncStepOutput


def test_what_the_output_thread_builds_runs_on_the_workers_stream():
    built = {}

    def step_output(step):
        built["restore"] = mx.ones((4,)) * 2  # lazy, as a hybrid state restore is
        return "output"

    runner = SimpleNamespace(_step_lock=threading.Lock(), _step_output=step_output,
                             _stream=mx.default_stream(mx.default_device()))
    step = SimpleNamespace(result=SimpleNamespace(tokens=mx.array([7, 8])))
    mx.eval(step.result.tokens)  # the worker evaluates it (async_eval) before the read
    reader = threading.Thread(target=lambda: built.update(out=_AsyncStepOutput(runner, step).get_output()))
    reader.start()
    reader.join()
    assert built["out"] == "output"
    assert (built["restore"] + 1).tolist() == [3.0] * 4  # evaluated on this (the worker's) thread
