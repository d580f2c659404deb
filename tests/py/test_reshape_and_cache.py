"""reshape_and_cache against a NumPy scatter, on both backends."""

import mlx.core as mx
import numpy as np
import pytest

from op_harness import DTYPES, random, to_numpy
from vllm_metal import _core, ops


def reference(key, value, key_cache, value_cache, slots):
    kc, vc = key_cache.copy(), value_cache.copy()
    nb, bs = kc.shape[:2]
    for t, s in enumerate(slots):
        if s >= 0:
            kc[s // bs, s % bs] = key[t]
            vc[s // bs, s % bs] = value[t]
    return kc, vc


def make_case(num_tokens, heads, head_size, block_size, num_blocks, dtype, seed, pad=0):
    rng = np.random.default_rng(seed)
    key = random((num_tokens, heads, head_size), dtype, seed)
    value = random((num_tokens, heads, head_size), dtype, seed + 1)
    key_cache = random((num_blocks, block_size, heads, head_size), dtype, seed + 2)
    value_cache = random((num_blocks, block_size, heads, head_size), dtype, seed + 3)
    slots = rng.permutation(num_blocks * block_size)[:num_tokens].astype(np.int64)
    if pad:
        slots[rng.choice(num_tokens, size=pad, replace=False)] = -1
    return key, value, key_cache, value_cache, slots


# (tokens, kv heads, head size, block size, blocks): one token, a whole block,
# block size +-1 tokens, head sizes of the supported models, many tokens.
CASES = [
    (1, 1, 64, 16, 1),
    (5, 3, 64, 16, 2),
    (15, 2, 80, 16, 3),
    (16, 8, 128, 16, 4),
    (17, 4, 96, 8, 5),
    (33, 1, 256, 32, 2),
    (200, 3, 64, 16, 20),
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", CASES, ids=lambda c: "t{}_h{}_d{}_bs{}_nb{}".format(*c))
def test_writes_the_slots(backend, case, dtype):
    key, value, kc, vc, slots = make_case(*case, dtype, seed=11, pad=min(2, case[0] - 1))
    expect_k, expect_v = reference(to_numpy(key), to_numpy(value), to_numpy(kc), to_numpy(vc), slots)
    kc, vc = ops.reshape_and_cache(key, value, kc, vc, mx.array(slots))
    # values are copied, never converted: exact equality
    np.testing.assert_array_equal(to_numpy(kc), expect_k)
    np.testing.assert_array_equal(to_numpy(vc), expect_v)


def test_key_and_value_views_of_a_fused_qkv(backend):
    # vLLM's qkv projection output: keys and values are strided views into it
    t, hq, hkv, d = 7, 6, 2, 64
    qkv = random((t, (hq + 2 * hkv) * d), "float16", seed=21)
    key = qkv[:, hq * d:(hq + hkv) * d].reshape(t, hkv, d)
    value = qkv[:, (hq + hkv) * d:].reshape(t, hkv, d)
    _, _, kc, vc, slots = make_case(t, hkv, d, 16, 2, "float16", seed=22)
    expect = reference(to_numpy(key), to_numpy(value), to_numpy(kc), to_numpy(vc), slots)
    kc, vc = ops.reshape_and_cache(key, value, kc, vc, mx.array(slots))
    np.testing.assert_array_equal(to_numpy(kc), expect[0])
    np.testing.assert_array_equal(to_numpy(vc), expect[1])
    # a transposed view (head and dim strides swapped) too
    kt = random((t, d, hkv), "float16", seed=23).transpose(0, 2, 1)
    expect = reference(to_numpy(kt), to_numpy(kt), to_numpy(kc), to_numpy(vc), slots)
    kc, vc = ops.reshape_and_cache(kt, kt, kc, vc, mx.array(slots))
    np.testing.assert_array_equal(to_numpy(kc), expect[0])


def test_all_slots_padding_leaves_the_cache_unchanged(backend):
    key, value, kc, vc, _ = make_case(4, 2, 64, 16, 1, "float32", seed=31)
    before = to_numpy(kc)
    kc2, _ = ops.reshape_and_cache(key, value, kc, vc, mx.array(np.full(4, -1, np.int64)))
    np.testing.assert_array_equal(to_numpy(kc2), before)


def test_old_cache_kept_by_a_reference_is_not_overwritten(backend):
    key, value, kc, vc, slots = make_case(3, 2, 64, 16, 1, "float32", seed=41)
    before = to_numpy(kc)
    old = kc  # a second reference: the op must copy, not write in place
    copies = _core.cache_write_copies()
    new_k, _ = ops.reshape_and_cache(key, value, kc, vc, mx.array(slots))
    mx.eval(new_k)
    np.testing.assert_array_equal(to_numpy(old), before)
    assert not np.array_equal(to_numpy(new_k), before)
    assert _core.cache_write_copies() == copies + 1  # the key cache (the value one is unread)


def test_steps_chain_through_the_returned_caches(backend):
    # a decode loop: each step writes one token and reads the cache afterwards
    heads, d = 2, 64
    kc = mx.zeros((2, 16, heads, d))
    vc = mx.zeros((2, 16, heads, d))
    expect = np.zeros((32, heads, d))
    for step in range(20):
        k = mx.full((1, heads, d), float(step + 1))
        kc, vc = ops.reshape_and_cache(k, k, kc, vc, mx.array(np.array([step], np.int64)))
        expect[step] = step + 1
        # reading the lazy result orders the write before the read
        assert float(mx.sum(kc).item()) == pytest.approx(expect.sum())
    np.testing.assert_array_equal(to_numpy(kc).reshape(32, heads, d), expect)


def _args():
    key = mx.zeros((2, 2, 64))
    cache = mx.zeros((1, 16, 2, 64))
    slots = mx.array(np.array([0, 1], np.int64))
    return key, cache, slots


@pytest.mark.parametrize(
    "make, error, message",
    [
        (lambda k, c, s: ops.reshape_and_cache(k, k, c, c, s.astype(mx.int32)), ValueError,
         r"\[reshape_and_cache\] slot_mapping must be int64, got int32"),
        (lambda k, c, s: ops.reshape_and_cache(k, k, c, c, s[:1]), ValueError,
         r"slot_mapping must be \[2\]"),
        (lambda k, c, s: ops.reshape_and_cache(k.astype(mx.float16), k.astype(mx.float16), c, c, s),
         ValueError, r"must share one dtype"),
        (lambda k, c, s: ops.reshape_and_cache(k, k, c[..., :32], c[..., :32], s), ValueError,
         r"cache heads x head_size 2x32 do not match key's 2x64"),
        (lambda k, c, s: ops.reshape_and_cache(k[0], k[0], c, c, s), ValueError,
         r"key must be \[tokens, kv_heads, head_size\]"),
        (lambda k, c, s: ops.reshape_and_cache(k, k, c, c, mx.array(np.array([0, 16], np.int64))),
         IndexError, r"slot_mapping\[1\] = 16 is outside the cache's 16 slots"),
    ],
)
def test_bad_input_raises_a_clear_error(make, error, message):
    key, cache, slots = _args()
    with pytest.raises(error, match=message):
        make(key, cache, slots)


def test_lazy_out_of_range_slot_loses_nothing(backend):
    # A slot table known only at eval: the CPU kernel refuses the whole step;
    # the Metal kernel cannot raise, so it skips the bad slot (never writes
    # outside the cache) and writes the rest.
    key, cache, slots = _args()
    key = key + 2.0
    cache = cache + 1.0
    mx.eval(key, cache)
    lazy_slots = mx.array(np.array([0, 5], np.int64)) * 10  # 0 and 50 (> 16 slots)
    kc, _ = ops.reshape_and_cache(key, key, cache, cache, lazy_slots)
    if backend == "native":
        with pytest.raises(RuntimeError, match=r"slot_mapping\[1\] = 50 is outside the cache's 16 slots"):
            mx.eval(kc)
    else:
        expect = np.ones((1, 16, 2, 64))
        expect[0, 0] = 2.0
        np.testing.assert_array_equal(to_numpy(kc), expect)
    assert float(mx.sum(cache).item()) == 16 * 2 * 64


def _address(a: mx.array) -> int:
    return np.frombuffer(memoryview(a), dtype=np.uint8).ctypes.data


def test_an_unshared_cache_is_updated_in_place(backend):
    # the serving loop rebinds its caches to the results: no copy per step
    key, value, kc, vc, slots = make_case(4, 2, 64, 16, 8, "float16", seed=51)
    mx.eval(kc, vc)
    k_addr, v_addr = _address(kc), _address(vc)
    kc, vc = ops.reshape_and_cache(key, value, kc, vc, mx.array(slots))
    mx.eval(kc, vc)
    assert (_address(kc), _address(vc)) == (k_addr, v_addr)


def test_inplace_writes_a_held_cache_without_copying(backend):
    # The serving loop under async scheduling: step N's pending work still holds the
    # caches when step N+1 writes them (here a second reference stands in for it).
    key, value, kc, vc, slots = make_case(5, 2, 64, 16, 4, "float16", seed=53, pad=1)
    mx.eval(kc, vc)
    expect = reference(to_numpy(key), to_numpy(value), to_numpy(kc), to_numpy(vc), slots)
    held_k, held_v = kc, vc
    addresses, copies = (_address(kc), _address(vc)), _core.cache_write_copies()
    kc, vc = ops.reshape_and_cache(key, value, kc, vc, mx.array(slots), inplace=True)
    mx.eval(kc, vc)
    assert _core.cache_write_copies() == copies
    assert (_address(kc), _address(vc)) == addresses
    np.testing.assert_array_equal(to_numpy(kc), expect[0])
    np.testing.assert_array_equal(to_numpy(vc), expect[1])
    np.testing.assert_array_equal(to_numpy(held_k), expect[0])  # the contract: rebind, the old shows the new
    np.testing.assert_array_equal(to_numpy(held_v), expect[1])


def test_reads_scheduled_before_an_inplace_write_see_the_old_contents(backend):
    # step N reads the cache, step N+1 writes it in place before N has run: stream order
    # (CPU tasks; on Metal a barrier or fence from the reader's in-place mark) keeps N's view
    key, value, kc, vc, slots = make_case(4, 2, 64, 16, 2, "float32", seed=54)
    mx.eval(kc, vc)
    old_sum = float(np.asarray(to_numpy(kc), np.float64).sum())
    read = mx.sum(kc.astype(mx.float32) * 1.0)  # step N's reader
    mx.async_eval(read)
    kc, vc = ops.reshape_and_cache(key, value, kc, vc, mx.array(slots), inplace=True)
    mx.async_eval(kc, vc)
    assert float(read.item()) == pytest.approx(old_sum, rel=1e-5)
    assert float(mx.sum(kc).item()) != pytest.approx(old_sum, rel=1e-5)


@pytest.mark.parametrize("invariant, kernels", [(False, ["decode", "reduce", "prefill"]),
                                                 (True, ["decode", "reduce"])])
def test_paged_attention_marks_the_caches_it_reads_for_in_place_writes(invariant, kernels):
    # on Metal these bindings are registered as written, so the next in-place write waits
    previous = ops.batch_invariant()
    ops.set_batch_invariant(invariant)
    try:
        plan = _core.plan_paged_attention("float16", 21, 3, 8, 2, 64, 16, 300, 200,
                                          num_decode_seqs=2, max_seq_len=3000, max_query_len=19)
    finally:
        ops.set_batch_invariant(previous)
    assert [l.kernel.split("_")[2] for l in plan] == kernels
    for launch in plan:
        marked = {b.array_slot for b in launch.buffers if b.read_before_in_place_write}
        assert marked == {1, 2}, launch.kernel
