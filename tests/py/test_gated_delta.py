"""gated_delta_rule against a float64 NumPy reference of the equations (both backends),
against mlx-lm's own Qwen3.5 gated delta (normalize_qk + gated_delta_update), chunked vs
recurrent, state carried across chunked-prefill steps, slots and donation, the errors."""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import numpy as np
import pytest

import hybrid_reference as ref
from op_harness import DTYPES, TOLERANCE, assert_close, to_numpy
from vllm_metal import _core, emulation, ops


@dataclass
class Case:
    lengths: tuple
    hk: int
    hv: int
    dk: int
    dv: int
    chunk_size: int = 64
    method: str = "auto"

    def id(self) -> str:
        return (f"gdn(len={list(self.lengths)},hk={self.hk},hv={self.hv},dk={self.dk},"
                f"dv={self.dv},{self.method},c={self.chunk_size})")


CASES = [
    Case((1, 1, 1), 1, 2, 32, 8),                        # decode, GQA 2
    Case((5, 1, 13), 2, 4, 64, 16),                      # mixed prefill + decode
    Case((3, 9), 1, 3, 48, 7, method="recurrent"),       # dk not a multiple of 32, odd dv
    Case((3, 4, 5, 9), 2, 2, 32, 12, chunk_size=4, method="chunked"),  # chunk edges +-1
    Case((0, 6, 2), 1, 1, 16, 5, chunk_size=3, method="chunked"),      # an empty sequence
    Case((2, 3), 1, 2, 192, 4),                          # dk 192: 6 values per Metal lane
    Case((1, 2), 2, 2, 256, 3),                          # dk 256: the Metal kernel's limit
]


def make_inputs(case: Case, dtype: str, seed: int, num_slots: int | None = None):
    rng = np.random.default_rng(seed)
    t = sum(case.lengths)
    n = len(case.lengths)
    num_slots = num_slots or n + 3
    cast = lambda x: mx.array(x.astype(np.float32)).astype(DTYPES[dtype])  # noqa: E731
    inp = dict(
        q=cast(rng.standard_normal((t, case.hk, case.dk))),
        k=cast(rng.standard_normal((t, case.hk, case.dk))),
        v=cast(rng.standard_normal((t, case.hv, case.dv))),
        a=cast(rng.standard_normal((t, case.hv))),
        b=cast(rng.standard_normal((t, case.hv))),
        A_log=mx.array(np.log(rng.uniform(1, 16, case.hv)).astype(np.float32)),
        dt_bias=mx.array(rng.standard_normal(case.hv).astype(np.float32)),
    )
    state = mx.array((rng.standard_normal((num_slots, case.hv, case.dv, case.dk)) * 0.5)
                     .astype(np.float32))
    slots = rng.permutation(num_slots)[:n].astype(np.int32)
    has_init = (np.arange(n) % 3 != 1).astype(np.int32)  # some requests start fresh
    return inp, state, slots, has_init


def numpy_inputs(inp):
    return {key: to_numpy(val) for key, val in inp.items()}


def run(inp, state, lengths, slots, has_init=None, **kw):
    return ops.gated_delta_rule(
        **inp, state=state, cu_seqlens=ref.i32(ref.cu_seqlens_of(lengths)), slots=ref.i32(slots),
        has_initial_state=None if has_init is None else ref.i32(has_init), **kw)


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("case", CASES, ids=Case.id)
def test_matches_reference(backend, case, dtype):
    inp, state, slots, has_init = make_inputs(case, dtype, seed=sum(case.lengths))
    y, new_state = run(inp, state, case.lengths, slots, has_init, method=case.method,
                       chunk_size=case.chunk_size)
    y_ref, s_ref = ref.gated_delta(**numpy_inputs(inp), state=np.array(state),
                                   cu=ref.cu_seqlens_of(case.lengths), slots=slots,
                                   has_init=has_init)
    assert y.dtype == inp["q"].dtype and new_state.dtype == mx.float32
    assert_close(y, y_ref, dtype, f"{case.id()} y")
    assert_close(new_state, s_ref, "float32", f"{case.id()} state")  # other slots unchanged


def test_matches_mlx_lm_qwen35_gated_delta():
    # mlx-lm's own path: normalize_qk, then gated_delta_update on [B, T, H, D] (B = 2
    # sequences of one length here; ours packs them)
    gd = pytest.importorskip("mlx_lm.models.gated_delta")
    case = Case((6, 6), 2, 4, 64, 16)
    inp, state, _, _ = make_inputs(case, "float32", seed=7, num_slots=2)
    b2 = lambda x: x.reshape(2, 6, *x.shape[1:])  # noqa: E731
    q, k = gd.normalize_qk(b2(inp["q"]), b2(inp["k"]), inv_scale=case.dk ** -0.5, eps=1e-6)
    y_ref, s_ref = gd.gated_delta_update(q, k, b2(inp["v"]), b2(inp["a"]), b2(inp["b"]),
                                         inp["A_log"], inp["dt_bias"], state, use_kernel=False)
    for method in ("recurrent", "chunked"):
        y, new_state = run(inp, state, case.lengths, np.array([0, 1]), method=method,
                           chunk_size=4)
        assert_close(y, to_numpy(y_ref.reshape(12, 4, 16)), "float32", f"mlx-lm y {method}")
        assert_close(new_state, to_numpy(s_ref), "float32", f"mlx-lm state {method}")


def test_chunked_equals_recurrent_on_long_rows():
    case = Case((200, 3, 130, 64), 2, 4, 64, 32)
    inp, state, slots, has_init = make_inputs(case, "float32", seed=11)
    y_r, s_r = run(inp, state, case.lengths, slots, has_init, method="recurrent")
    y_c, s_c = run(inp, state, case.lengths, slots, has_init, method="chunked")
    assert_close(y_c, to_numpy(y_r), "float32", "chunked vs recurrent y")
    assert_close(s_c, to_numpy(s_r), "float32", "chunked vs recurrent state")


@pytest.mark.parametrize("method", ["recurrent", "chunked"])
def test_state_across_chunked_prefill_steps_equals_one_prefill(backend, method):
    # request A's 21-token prompt in steps of 7, 5, 9 (next to request B decoding) gives
    # the same outputs and final state as one 21-token prefill
    case = Case((21,), 1, 2, 32, 8, chunk_size=4, method=method)
    inp, state, _, _ = make_inputs(case, "float32", seed=3, num_slots=3)
    y_one, s_one = run(inp, state, [21], [2], method=method, chunk_size=4)
    ys, st, start = [], state, 0
    b_inp, _, _, _ = make_inputs(Case((3,), 1, 2, 32, 8), "float32", seed=4)
    for i, step in enumerate((7, 5, 9)):
        part = {key: (val[start:start + step] if val.ndim > 1 else val)
                for key, val in inp.items()}
        both = {key: (mx.concatenate([part[key], b_inp[key][i:i + 1]]) if val.ndim > 1
                      else val) for key, val in part.items()}
        y, st = run(both, st, [step, 1], [2, 0], method=method, chunk_size=4)
        ys.append(y[:step])
        start += step
    assert_close(mx.concatenate(ys), to_numpy(y_one), "float32", "stepped y")
    assert_close(st[2], to_numpy(s_one[2]), "float32", "stepped state")


@pytest.mark.parametrize("cut", [1, 8, 20])
def test_recurrent_state_resumes_bit_exactly_at_any_cut(backend, cut):
    # Hybrid prefix caching (hybrid.py) saves the state after `cut` tokens and resumes a
    # later request from it: the rows and the final state must be the ones one pass gives,
    # bit for bit (the recurrent kernel is the method "auto" runs and Metal's only one).
    case = Case((21,), 2, 4, 64, 16)
    inp, state, _, _ = make_inputs(case, "float32", seed=5, num_slots=2)
    y_one, s_one = run(inp, state, [21], [1], [0])
    first = {key: (val[:cut] if val.ndim > 1 else val) for key, val in inp.items()}
    rest = {key: (val[cut:] if val.ndim > 1 else val) for key, val in inp.items()}
    y_a, saved = run(first, state, [cut], [1], [0])
    y_b, s_two = run(rest, saved, [21 - cut], [1], [1])
    assert mx.array_equal(mx.concatenate([y_a, y_b]), y_one).item()
    assert mx.array_equal(s_two[1], s_one[1]).item()


def test_state_is_copied_unless_inplace(backend):
    case = Case((4, 2), 1, 2, 32, 8)
    inp, state, slots, _ = make_inputs(case, "float32", seed=5, num_slots=64)
    before = np.array(state)
    y1, s1 = run(inp, state, case.lengths, slots)
    mx.eval(y1, s1)
    np.testing.assert_array_equal(np.array(state), before)  # the old state is intact
    old = state * 1.0
    mx.eval(old)
    mx.reset_peak_memory()
    active = mx.get_active_memory()
    y2, s2 = run(inp, old, case.lengths, slots, inplace=True)
    mx.eval(y2, s2)
    assert mx.get_peak_memory() - active < old.nbytes / 2  # no second state buffer
    assert mx.array_equal(y1, y2).item() and mx.array_equal(s1, s2).item()
    assert mx.array_equal(old, s2).item()  # the old buffer holds the new state


def test_kernel_names_are_instantiated():
    names = {l.kernel for d in DTYPES for l in
             _core.plan_gated_delta(d, 3, 5, 2, 4, 64, 16, copy_state=True)}
    assert names <= set(emulation.library("gated_delta").kernels)


def test_empty_batch():
    inp, state, _, _ = make_inputs(Case((0,), 1, 1, 16, 4), "float32", seed=1)
    y, s = run(inp, state, [0], [0])
    assert y.shape == (0, 1, 4) and mx.array_equal(s, state).item()


# ---- errors ------------------------------------------------------------------------------


def _bad(**override):
    case = Case((2, 1), 1, 2, 16, 4)
    inp, state, slots, _ = make_inputs(case, "float32", seed=2)
    kw = dict(inp, state=state, cu_seqlens=ref.i32([0, 2, 3]), slots=ref.i32(slots))
    kw.update(override)
    return lambda: ops.gated_delta_rule(**kw)


@pytest.mark.parametrize(
    "make, message",
    [
        (_bad(q=mx.zeros((3, 1, 16), mx.int32)), r"\[gated_delta_rule\] q must be float32, float16 or bfloat16, got int32"),
        (_bad(k=mx.zeros((3, 1, 8))), r"k must be \[3, 1, 16\], got \[3, 1, 8\]"),
        (_bad(v=mx.zeros((3, 2, 4), mx.float16)), r"v must have q's dtype float32, got float16"),
        (_bad(q=mx.zeros((3, 2, 16)), k=mx.zeros((3, 2, 16)), v=mx.zeros((3, 3, 4))),
         r"num_v_heads \(3\) must be a multiple of num_k_heads \(2\)"),
        (_bad(state=mx.zeros((5, 2, 4, 16), mx.float16)), r"state must be float32, got float16"),
        (_bad(state=mx.zeros((5, 2, 16, 4))), r"state must be \[num_slots, 2, 4, 16\], got \[5, 2, 16, 4\]"),
        (_bad(a=mx.zeros((3, 1))), r"a must be \[3, 2\], got \[3, 1\]"),
        (_bad(slots=ref.i32([0, 5])), r"slots\[1\] = 5 is out of range for a state of 5 slots"),
        (_bad(slots=ref.i32([-1, 0])), r"slots\[0\] = -1 is out of range"),
        (_bad(slots=ref.i32([1, 1])), r"slot 1 is used by two sequences"),
        (_bad(slots=mx.zeros((2,), mx.int64)), r"slots must be int32, got int64"),
        (_bad(cu_seqlens=ref.i32([0, 2, 4])), r"cu_seqlens\[-1\] must be the number of rows 3, got 4"),
        (_bad(cu_seqlens=ref.i32([0, 3, 2, 3]), slots=ref.i32([0, 1, 2])),
         r"cu_seqlens must be non-decreasing"),
        (_bad(q=mx.zeros((3, 1, 272)), k=mx.zeros((3, 1, 272)), state=mx.zeros((5, 2, 4, 272))),
         r"k_head_dim must be in \[1, 256\], got 272"),
        (_bad(method="parallel"), r"method must be 'auto', 'recurrent' or 'chunked', got 'parallel'"),
    ],
)
def test_bad_input_raises_a_clear_error(make, message):
    with pytest.raises(ValueError, match=message):
        make()
