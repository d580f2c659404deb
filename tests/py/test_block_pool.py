"""BlockPool and BlockHashChain through the bindings: the API, bad input, and
Hypothesis runs of random operation sequences against a small pure-Python model.

The model (ModelPool) is the pool's specification written plainly: a list for
the free queue, a dict of ref counts, a dict hash -> blocks. Every operation is
applied to both; results, exceptions and the whole state must agree after each.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from vllm_metal._core import BlockHashChain, BlockPool

SEED = 99


def chain(tokens, block_size=4, **kw):
    c = BlockHashChain(block_size, seed=SEED, **kw)
    c.append(list(tokens))
    return c


# ---- the model ----------------------------------------------------------------------


class ModelPool:
    """The pool's behaviour, plainly. Raises ValueError where the pool must,
    before changing anything."""

    def __init__(self, num_blocks, block_size, *, enable_caching=True, reserve_null_block=True):
        self.n = num_blocks
        self.bs = block_size
        self.caching = enable_caching
        self.null = 0 if reserve_null_block else None
        self.queue = [b for b in range(num_blocks) if b != self.null]
        self.ref = [0] * num_blocks
        self.hash = {}  # block -> hash
        self.cache = {}  # hash -> [blocks], oldest first
        self.events = []
        self.evicted = 0

    def _check(self, ids):
        for b in ids:
            if not 0 <= b < self.n:
                raise ValueError(f"block id {b} outside")

    def _uncache(self, b):
        h = self.hash.pop(b)
        self.cache[h].remove(b)
        if not self.cache[h]:
            del self.cache[h]
        self.evicted += 1
        self.events.append(("removed", b, h))

    def allocate(self, n):
        if n < 0 or n > len(self.queue):
            raise ValueError("cannot allocate")
        out, self.queue = self.queue[:n], self.queue[n:]
        for b in out:
            if b in self.hash:
                self._uncache(b)
            self.ref[b] = 1
        return out

    def free(self, ids):
        self._check(ids)
        counts = {}
        for b in ids:
            if b != self.null:
                counts[b] = counts.get(b, 0) + 1
                if counts[b] > self.ref[b]:
                    raise ValueError("double free")
        front, back = [], []
        for b in ids:
            if b == self.null:
                continue
            self.ref[b] -= 1
            if self.ref[b] == 0:
                (back if b in self.hash else front).append(b)
        self.queue = front + self.queue + back

    def touch(self, ids):
        self._check(ids)
        for b in ids:
            if b != self.null and self.ref[b] == 0 and b not in self.hash:
                raise ValueError("free and uncached")
        for b in ids:
            if b == self.null:
                continue
            if self.ref[b] == 0:
                self.queue.remove(b)
            self.ref[b] += 1

    def count_free(self, ids):
        self._check(ids)
        return len({b for b in ids if b != self.null and self.ref[b] == 0})

    def lookup(self, hashes, max_blocks=None):
        out = []
        for h in hashes[: len(hashes) if max_blocks is None else max_blocks]:
            if h not in self.cache:
                break
            out.append(self.cache[h][0])
        return out

    def find_cached_prefix(self, hashes, num_tokens):
        if not self.caching:
            return []
        return self.lookup(hashes, (num_tokens - 1) // self.bs if num_tokens > 0 else 0)

    def cache_full_blocks(self, ids, hashes, num_cached, num_full):
        if num_cached > num_full or num_full > len(ids) or num_full > len(hashes):
            raise ValueError("bad range")
        seen = {}
        for i in range(num_cached, num_full):
            b, h = ids[i], hashes[i]
            self._check([b])
            if b == self.null:
                continue
            if self.ref[b] == 0:
                raise ValueError("free block")
            if b in self.hash and self.hash[b] != h:
                raise ValueError("other hash")
            if b in seen and seen[b] != h:
                raise ValueError("different hashes")
            seen.setdefault(b, h)
        if not self.caching:
            return
        for i in range(num_cached, num_full):
            b, h = ids[i], hashes[i]
            if b == self.null or b in self.hash:
                continue
            self.hash[b] = h
            self.cache.setdefault(h, []).append(b)
            self.events.append(("stored", b, h))

    def evict_cached(self, ids):
        self._check(ids)
        for b in ids:
            if b in self.hash:
                self._uncache(b)

    def reset_prefix_cache(self):
        if any(self.ref[b] > 0 for b in range(self.n)):
            return False
        self.hash.clear()
        self.cache.clear()
        self.events.append(("all_cleared", -1, None))
        return True


# ---- the API ---------------------------------------------------------------------------


def state(pool):
    return (
        pool.free_queue(),
        [pool.ref_count(b) for b in range(pool.num_blocks)],
        [pool.is_cached(b) for b in range(pool.num_blocks)],
        pool.num_free_blocks,
    )


def rejected(pool, fn, match):
    before = state(pool)
    with pytest.raises(ValueError, match=match):
        fn()
    assert state(pool) == before
    pool.check_invariants()


def test_pool_properties():
    p = BlockPool(10, 16)
    assert (p.num_blocks, p.block_size, p.null_block, p.num_free_blocks, p.num_usable_blocks) == (10, 16, 0, 9, 9)
    assert p.enable_caching and p.usage == 0.0
    q = BlockPool(10, 16, reserve_null_block=False, enable_caching=False)
    assert q.null_block is None and q.num_free_blocks == 10 and not q.enable_caching
    with pytest.raises(ValueError, match=r"^\[BlockPool\] num_blocks must be in \[1, 2\^31 - 3\], got 0"):
        BlockPool(0, 16)
    with pytest.raises(ValueError, match="block_size must be > 0"):
        BlockPool(4, 0)
    with pytest.raises(ValueError, match=r"^\[BlockHashChain\] block_size must be > 0"):
        BlockHashChain(0)


def test_bad_input_raises_value_error_and_changes_nothing():
    p = BlockPool(8, 4)
    a = p.allocate(3)
    c = chain(range(12))
    p.cache_full_blocks(a, c, 0, 2)
    rejected(p, lambda: p.free([a[0], a[0]]), r"freed 2 times but has 1 reference")
    rejected(p, lambda: p.free([5]), r"block 5 is already free \(double free\)")
    rejected(p, lambda: p.free([a[1], 8]), r"block id 8 is outside the pool \(ids 0\.\.7\)")
    rejected(p, lambda: p.free([-3]), "outside the pool")
    rejected(p, lambda: p.touch([6]), "block 6 is free and holds no cached prefix")
    rejected(p, lambda: p.touch([1, 99]), "outside the pool")
    rejected(p, lambda: p.allocate(6), r"cannot allocate 6 blocks, 4 free \(of 7 usable\)")
    rejected(p, lambda: p.allocate(-1), "must be >= 0")
    rejected(p, lambda: p.cache_full_blocks(a, chain(range(100, 112)), 0, 3), "already cached under another hash")
    rejected(p, lambda: p.cache_full_blocks([7, 6, 5], c, 0, 3), "block 7 is free")
    rejected(p, lambda: p.cache_full_blocks(a, c, 0, 4), "needs that many block ids and hashes")
    rejected(p, lambda: p.evict_cached([1, 8]), "outside the pool")
    rejected(p, lambda: p.count_free([8]), "outside the pool")
    rejected(p, lambda: p.find_cached_prefix(c, -1), "num_tokens must be >= 0")
    with pytest.raises(ValueError, match="outside the pool"):
        p.ref_count(8)
    with pytest.raises(ValueError, match="holds no cached prefix"):
        p.block_hash(a[2])
    with pytest.raises(TypeError):
        p.free([2**40])  # not an int32: the binding refuses it


def test_prefix_cache_round_trip():
    p = BlockPool(16, 4, enable_events=True)
    c = chain(range(10))  # 2 full blocks + 2 tokens
    assert len(c) == 2 and c.num_tokens == 10 and len(c.hashes) == 2 and len(c.hashes[0]) == 16
    blocks = p.allocate(3)
    p.cache_full_blocks(blocks, c, 0, len(c))
    assert [e.kind for e in p.take_events()] == ["stored", "stored"]
    p.free(blocks[::-1])
    assert p.free_queue()[-2:] == [blocks[1], blocks[0]]  # cached blocks at the back, tail first
    again = chain(range(10))
    assert p.find_cached_prefix(again) == blocks[:2]
    assert p.find_cached_prefix(chain(range(8))) == blocks[:1]  # 8 tokens: the last is computed
    assert p.lookup(chain(range(8))) == blocks[:2]
    assert p.lookup(again, max_blocks=1) == blocks[:1]
    assert p.count_free(blocks[:2]) == 2
    assert p.block_hash(blocks[0]) == c.hashes[0]
    s = p.stats
    assert (s.lookups, s.lookup_tokens, s.hit_tokens, s.allocated, s.stored) == (2, 18, 12, 3, 2)
    p.touch(blocks[:2])
    assert p.ref_count(blocks[0]) == 1 and p.num_free_blocks == 13
    p.free(blocks[1::-1])
    assert p.reset_prefix_cache()
    assert [e.kind for e in p.take_events()] == ["all_cleared"]
    assert p.find_cached_prefix(again) == []
    p.reset_stats()
    assert p.stats.lookups == 0


def test_eviction_event_names_block_and_hash():
    p = BlockPool(4, 2, enable_events=True)  # 3 usable
    c = chain([1, 2, 3], block_size=2)
    b = p.allocate(2)
    p.cache_full_blocks(b, c, 0, 1)
    p.free(b[::-1])
    p.take_events()
    assert p.allocate(3)[-1] == b[0]  # the cached block is the last to go
    (ev,) = p.take_events()
    assert (ev.kind, ev.block_id, ev.hash, ev.parent) == ("removed", b[0], c.hashes[0], None)


def test_chain_extra_keys_and_request_key():
    tokens = list(range(16))
    base = chain(tokens)
    lora = chain(tokens, request_key=5)
    assert lora.request_key == 5 and lora.seed == SEED and lora.root != base.root
    assert all(x != y for x, y in zip(base.hashes, lora.hashes))
    mm = BlockHashChain(4, seed=SEED)
    mm.add_extra_key(8, 3, 0xABC)  # an image over tokens 8..10: block 2
    mm.append(tokens)
    assert mm.hashes[:2] == base.hashes[:2] and mm.hashes[2] != base.hashes[2]
    with pytest.raises(ValueError, match="covers a block already hashed"):
        mm.add_extra_key(4, 1, 1)
    import numpy as np

    arr = BlockHashChain(4, seed=SEED)
    assert arr.append(np.arange(16, dtype=np.int32)) == 4
    assert arr.hashes == base.hashes
    # Without a seed, the process's random seed: stable within the process.
    assert BlockHashChain(4).seed == BlockHashChain(4).seed


# ---- properties ---------------------------------------------------------------------


tokens_st = st.lists(st.integers(0, 2), min_size=0, max_size=14)  # tiny vocab: many shared blocks


@settings(max_examples=300, deadline=None)
@given(a=tokens_st, b=tokens_st, block_size=st.integers(1, 4), key_a=st.integers(0, 2), key_b=st.integers(0, 2))
def test_chain_hashes_equal_exactly_for_equal_prefixes(a, b, block_size, key_a, key_b):
    ca, cb = chain(a, block_size, request_key=key_a), chain(b, block_size, request_key=key_b)
    assert len(ca) == len(a) // block_size
    for i in range(min(len(ca), len(cb))):
        same = a[: (i + 1) * block_size] == b[: (i + 1) * block_size] and key_a == key_b
        assert (ca.hashes[i] == cb.hashes[i]) == same


@settings(max_examples=100, deadline=None)
@given(tokens=tokens_st, cuts=st.lists(st.integers(0, 14), max_size=5), block_size=st.integers(1, 5))
def test_chain_does_not_depend_on_how_tokens_arrive(tokens, cuts, block_size):
    c = BlockHashChain(block_size, seed=SEED)
    prev = 0
    for cut in sorted(cuts) + [len(tokens)]:
        cut = min(cut, len(tokens))
        c.append(tokens[prev:cut])
        prev = max(prev, cut)
    assert c.hashes == chain(tokens, block_size).hashes


class PoolMachine(RuleBasedStateMachine):
    """Random operations on BlockPool and ModelPool, compared after each."""

    def __init__(self):
        super().__init__()
        self.pool = None

    @precondition(lambda self: self.pool is None)
    @rule(num_blocks=st.integers(1, 14), block_size=st.integers(1, 3), caching=st.booleans(),
          null_block=st.booleans())
    def init(self, num_blocks, block_size, caching, null_block):
        self.pool = BlockPool(num_blocks, block_size, enable_caching=caching,
                              reserve_null_block=null_block, enable_events=True)
        self.model = ModelPool(num_blocks, block_size, enable_caching=caching, reserve_null_block=null_block)
        self.requests = []  # [tokens, chain, blocks, num_cached]

    def both(self, name, *args, model_args=None):
        """Calls `name` on both; they must agree on the result or both raise."""
        try:
            expect = getattr(self.model, name)(*(args if model_args is None else model_args))
        except ValueError:
            expect = ValueError
        try:
            got = getattr(self.pool, name)(*args)
        except ValueError:
            got = ValueError
        assert got == expect, f"{name}{args}: pool {got}, model {expect}"
        return got

    # requests: the way a scheduler uses the pool
    @precondition(lambda self: self.pool is not None)
    @rule(tokens=st.lists(st.integers(0, 2), min_size=1, max_size=12))
    def admit(self, tokens):
        c = chain(tokens, self.pool.block_size)
        hit = self.both("find_cached_prefix", c, c.num_tokens, model_args=(c.hashes, c.num_tokens))
        for i, b in enumerate(hit):  # cached prefix correctness
            assert self.pool.block_hash(b) == c.hashes[i]
        need = -(-len(tokens) // self.pool.block_size) - len(hit)
        if need + self.both("count_free", hit) > self.pool.num_free_blocks:
            return
        self.both("touch", hit)
        blocks = hit + self.both("allocate", need)
        self.both("cache_full_blocks", blocks, c, len(hit), len(c), model_args=(blocks, c.hashes, len(hit), len(c)))
        self.requests.append([tokens, c, blocks, len(c)])

    @precondition(lambda self: self.pool is not None and self.requests)
    @rule(i=st.integers(0, 100), more=st.lists(st.integers(0, 2), min_size=1, max_size=6))
    def grow(self, i, more):
        r = self.requests[i % len(self.requests)]
        r[0] = r[0] + more
        r[1].append(more)
        need = -(-len(r[0]) // self.pool.block_size) - len(r[2])
        if need > self.pool.num_free_blocks:
            return
        r[2] = r[2] + self.both("allocate", max(need, 0))
        c = r[1]
        if len(c) > r[3]:
            self.both("cache_full_blocks", r[2], c, r[3], len(c), model_args=(r[2], c.hashes, r[3], len(c)))
            r[3] = len(c)

    @precondition(lambda self: self.pool is not None and self.requests)
    @rule(i=st.integers(0, 100))
    def release(self, i):
        r = self.requests.pop(i % len(self.requests))
        self.both("free", r[2][::-1])

    # raw operations, valid or not
    ids_st = st.lists(st.integers(-2, 16), max_size=4)

    @precondition(lambda self: self.pool is not None)
    @rule(ids=ids_st)
    def free_any(self, ids):
        if self.both("free", ids) is not ValueError:
            self.requests.clear()  # holdings may be gone: forget them (both sides agree anyway)

    @precondition(lambda self: self.pool is not None)
    @rule(ids=ids_st)
    def touch_any(self, ids):
        self.both("touch", ids)

    @precondition(lambda self: self.pool is not None)
    @rule(n=st.integers(-1, 16))
    def allocate_any(self, n):
        self.both("allocate", n)

    @precondition(lambda self: self.pool is not None)
    @rule(ids=ids_st, tokens=st.lists(st.integers(0, 2), max_size=12), lo=st.integers(0, 4), hi=st.integers(0, 5))
    def cache_any(self, ids, tokens, lo, hi):
        c = chain(tokens, self.pool.block_size)
        self.both("cache_full_blocks", ids, c, lo, hi, model_args=(ids, c.hashes, lo, hi))

    @precondition(lambda self: self.pool is not None)
    @rule(ids=ids_st)
    def evict_any(self, ids):
        self.both("evict_cached", ids)

    @precondition(lambda self: self.pool is not None)
    @rule()
    def reset(self):
        self.both("reset_prefix_cache")

    @precondition(lambda self: self.pool is not None)
    @rule(tokens=st.lists(st.integers(0, 2), max_size=12), max_blocks=st.integers(0, 6))
    def lookup(self, tokens, max_blocks):
        c = chain(tokens, self.pool.block_size)
        self.both("lookup", c, max_blocks, model_args=(c.hashes, max_blocks))

    @invariant()
    def same_state(self):
        if self.pool is None:
            return
        p, m = self.pool, self.model
        p.check_invariants()
        assert p.free_queue() == m.queue
        refs = [p.ref_count(b) for b in range(p.num_blocks)]
        assert refs == m.ref
        cached = {b: p.block_hash(b) for b in range(p.num_blocks) if p.is_cached(b)}
        assert cached == m.hash
        used = {b for b in range(p.num_blocks) if refs[b] > 0}
        free = set(p.free_queue())
        assert not used & free  # no block both free and used
        assert used | free | ({m.null} - {None}) == set(range(p.num_blocks))
        assert p.num_free_blocks == len(m.queue) and p.num_cached_blocks == len(m.hash)
        events = [(e.kind, e.block_id, e.hash) for e in p.take_events()]
        assert events == m.events
        m.events = []
        assert p.stats.evicted == m.evicted


TestPoolMachine = PoolMachine.TestCase
TestPoolMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None,
                                    suppress_health_check=[HealthCheck.too_slow])


@settings(max_examples=50, deadline=None)
@given(num_blocks=st.integers(2, 40), ops=st.lists(st.tuples(st.booleans(), st.integers(1, 5)), max_size=40))
def test_usage_and_counts_add_up(num_blocks, ops):
    p = BlockPool(num_blocks, 4)
    held = []
    for alloc, n in ops:
        if alloc and n <= p.num_free_blocks:
            held.append(p.allocate(n))
        elif held:
            p.free(held.pop()[::-1])
        assert p.num_used_blocks + p.num_free_blocks == p.num_usable_blocks
        assert p.usage == pytest.approx(p.num_used_blocks / p.num_usable_blocks)
