"""Custom logits processors (vLLM's V1 interface) on the native sampler: the
BatchUpdates they get follow the step's rows, their edits land where vLLM's Sampler
applies them, the output-id lists they hold stay current, and the V2 contract refuses
them at load. The processors are tests/py/sample_logits_processors.py."""

from __future__ import annotations

from types import SimpleNamespace

import mlx.core as mx
import numpy as np
import pytest
from vllm import SamplingParams

from sample_logits_processors import ForceToken, ForceTokenV2, KeepTop
from sampling_reference import log_softmax
from test_sampling_processing import V, batch_of, rand_logits
from vllm_metal.sampling import Sampler, custom_processors
from vllm_metal.sampling.custom_processors import CustomProcessors


def _config(names=()):
    return SimpleNamespace(model_config=SimpleNamespace(logits_processors=list(names)))


def _procs():
    return CustomProcessors(_config(), [ForceToken, KeepTop])


def _params(force=None, keep=None, **kw):
    extra = {k: v for k, v in (("force_token", force), ("keep_top", keep)) if v is not None}
    return SamplingParams(extra_args=extra or None, **kw)


def test_batch_updates_follow_the_rows_of_each_step():
    cp = _procs()
    force = {"a": 5, "b": None, "c": 9, "d": 11}
    for r, t in force.items():
        cp.add(r, _params(force=t), [1, 2], [])
    steps = [["a", "b", "c"], ["a", "b", "c"], ["c", "a"], ["d", "c", "b", "a"], ["b"], []]
    gone = {3: [], 4: ["a", "c", "d"]}
    for n, batch in enumerate(steps):
        cp.remove(gone.get(n, []))
        cp.step(batch)
        proc = cp.procs[0]
        # the processor's state, rebuilt from its updates alone, says which row forces what
        assert proc.rows == {i: force[r] for i, r in enumerate(batch) if force[r] is not None}
        assert all(i < len(batch) for i in proc.rows)
        if n == 1:
            assert proc.updates[-1] is None  # the same rows: no update
        else:
            u = proc.updates[-1]
            assert u.batch_size == len(batch) and not u.moved
            assert not set(u.removed) & {a[0] for a in u.added}  # vLLM never sends both


def test_output_lists_handed_over_are_extended_in_place():
    cp = _procs()
    cp.add("a", _params(force=3), [7, 8], [4])
    cp.step(["a"])
    held = cp.procs[0].outputs[0]
    assert held == [4]
    cp.sync_outputs({"a": [7, 8, 4, 3, 3]}.__getitem__)
    assert held == [4, 3, 3] and cp.procs[0].outputs[0] is held


def test_edits_run_where_vllms_sampler_runs_them():
    params = [_params(force=17, temperature=0, logprobs=2),  # greedy, forced
              _params(keep=1, temperature=1.0, seed=3, logprobs=2),  # random, keeps its argmax
              _params(temperature=0, logit_bias={40: 50.0})]  # untouched by the processors
    _, b = batch_of(params, [[1, 2]] * 3, [2] * 3)
    cp = _procs()
    for i, p in enumerate(params):
        cp.add(f"r{i}", p, [1, 2], [])
    assert cp.step(["r0", "r1", "r2"])
    b.custom = cp
    logits = rand_logits(3, seed=8)
    r = Sampler()(mx.array(logits), b)
    tokens = np.array(r.tokens)
    assert tokens[0] == 17 and tokens[1] == np.argmax(logits[1]) and tokens[2] == 40
    # raw logprobs come from the logits before any processor
    ids, lps, _ = (np.array(a) for a in r.logprobs)
    np.testing.assert_allclose(lps[:2], log_softmax(logits)[np.arange(2)[:, None], ids[:2]],
                               atol=1e-5)
    # processed: the forced row has one finite logprob (0), the kept row too
    r = Sampler("processed_logprobs")(mx.array(logits), b)
    _, lps, _ = (np.array(a) for a in r.logprobs)
    assert lps[0, 0] == pytest.approx(0.0) and lps[1, 0] == pytest.approx(0.0)
    assert np.isneginf(lps[:2, 2]).all()  # the second-best is gone in both rows


def test_argmax_invariant_processors_skip_all_greedy_batches():
    params = [_params(keep=1, temperature=0)]
    _, b = batch_of(params, [[1, 2]], [2])
    cp = _procs()
    cp.add("r0", params[0], [1, 2], [])
    cp.step(["r0"])
    calls = []
    cp.argmax_invariant[0].apply = lambda t: calls.append(t) or t
    b.custom = cp
    Sampler()(mx.array(rand_logits(1)), b)
    assert not calls


def test_native_and_torch_samplers_agree_with_a_custom_processor():
    from vllm_metal.sampling.torch_sampler import TorchSampler

    params = [_params(force=33, temperature=0, logprobs=3), _params(temperature=0, logprobs=3)]
    _, b = batch_of(params, [[1, 2, 3]] * 2, [2] * 2, for_reference=True)
    cp = _procs()
    for i, p in enumerate(params):
        cp.add(f"r{i}", p, [1, 2], [3])
    cp.step(["r0", "r1"])
    b.custom = cp
    logits = rand_logits(2, seed=6)
    ours, theirs = Sampler()(mx.array(logits), b), TorchSampler()(mx.array(logits), b)
    assert np.array(ours.tokens).tolist() == np.array(theirs.tokens).tolist()
    assert np.array(ours.tokens)[0] == 33
    for a, c in zip(ours.logprobs, theirs.logprobs):
        np.testing.assert_allclose(np.array(a), np.array(c), atol=1e-5)


def _v2_config(names=()):
    mc = SimpleNamespace(logits_processors=list(names), get_vocab_size=lambda: V,
                         max_model_len=16)
    return SimpleNamespace(model_config=mc)


def test_loading_follows_the_runner_contract():
    name = "sample_logits_processors:ForceToken"
    assert custom_processors.load(_config(), use_v2=False) is None  # none configured
    assert custom_processors.load(_v2_config(), use_v2=True, max_num_reqs=4) is None
    cp = custom_processors.load(_config([name]), use_v2=False)
    assert [type(p) for p in cp.procs] == [ForceToken] and cp.edits and not cp.argmax_invariant
    with pytest.raises(ValueError, match="not a subclass"):  # vLLM V2's loader: V1 classes
        custom_processors.load(_v2_config([name]), use_v2=True, max_num_reqs=4)
    v2 = custom_processors.load(_v2_config(["sample_logits_processors:ForceTokenV2"]),
                                use_v2=True, max_num_reqs=4)
    assert [type(p) for p in v2.procs] == [ForceTokenV2]


def test_v2_processors_get_slots_context_and_request_state():
    v2 = custom_processors.load(_v2_config(["sample_logits_processors:ForceTokenV2"]),
                                use_v2=True, max_num_reqs=4)
    params = [_params(force=17, temperature=0), _params(temperature=0, logit_bias={40: 50.0}),
              SamplingParams(temperature=0, extra_args={"repeat_last": 1})]
    tokens = {"r0": [1, 2, 5], "r1": [3, 4], "r2": [6, 7, 8, 9]}
    v2.add("gone", params[0], [1], [], row=0)
    for (r, toks), p in zip(tokens.items(), params):
        v2.add(r, p, toks[:2], toks[2:], row=0)
        if r == "r0":
            v2.remove(["gone"])  # its slot is free again
    assert v2.slot_of == {"r0": 1, "r1": 0, "r2": 2}  # slots below max_num_reqs, reused
    assert not v2.step(["r1"], None, np.array([2]))  # no active row: not run
    assert v2.step(["r0", "r1", "r2"], None, np.array([3, 2, 4]))
    tokens["r2"] += [11]  # a token sampled since it was added
    v2.sync_outputs(tokens.__getitem__)
    assert v2.state.total_len.np[2] == 5 and v2.state.all_token_ids.np[2, :5].tolist() == [6, 7, 8, 9, 11]
    _, b = batch_of(params, [tokens[r] for r in ("r0", "r1", "r2")], [2, 2, 2])
    b.custom = v2
    logits = rand_logits(3, seed=9)
    tokens_out = np.array(Sampler()(mx.array(logits), b).tokens)
    assert tokens_out.tolist() == [17, 40, 11]  # forced; untouched (its bias); its last token
