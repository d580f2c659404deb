"""emulation.build_all: processes loading the emulated kernels at once share the builds of a
cold cache instead of each compiling every source."""

import threading
import time

import pytest

from vllm_metal import emulation


class _ColdCache:
    """Stands in for the emulator's build cache: the first lookup of a source compiles it
    (slowly, without a lock of its own, as mslemu does), later lookups find it."""

    def __init__(self):
        self.compiles: dict[str, int] = {}
        self.built: set[str] = set()
        self.guard = threading.Lock()

    def library(self, source: str) -> str:
        if source in self.built:
            return source
        with self.guard:
            self.compiles[source] = self.compiles.get(source, 0) + 1
        time.sleep(0.05)  # the compiler
        self.built.add(source)
        return source


@pytest.fixture
def cold_cache(tmp_path, monkeypatch):
    cache = _ColdCache()
    monkeypatch.setenv("MSLEMU_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(emulation, "kernel_sources", lambda: [f"source{i}" for i in range(8)])
    monkeypatch.setattr(emulation, "library", cache.library)
    return cache


def _build_concurrently(workers: int) -> list[set]:
    """build_all in `workers` threads at once (each as a process would: its own cache of
    what it built); returns, per worker, the sources built when its build_all returned."""
    done: list[set] = []
    start = threading.Barrier(workers)

    def worker():
        start.wait()
        emulation.build_all.__wrapped__()  # not the per-process memo: each thread is a process
        done.append(set(emulation.library.__self__.built))

    threads = [threading.Thread(target=worker) for _ in range(workers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    return done


def test_concurrent_builds_compile_each_source_once(cold_cache):
    done = _build_concurrently(3)
    sources = set(emulation.kernel_sources())
    assert cold_cache.compiles == {s: 1 for s in sources}
    # every worker returns only once every source is in the cache, its own or another's
    assert done == [sources] * 3


def test_a_source_another_process_is_building_is_waited_for(cold_cache, tmp_path):
    import fcntl

    held = open(tmp_path / ".source3.build-lock", "w")
    fcntl.flock(held, fcntl.LOCK_EX)  # another process is building source3
    finished = threading.Event()
    t = threading.Thread(target=lambda: (emulation.build_all.__wrapped__(), finished.set()))
    t.start()
    time.sleep(1.0)
    assert not finished.is_set()  # built the others, now waits for source3
    assert "source3" not in cold_cache.compiles and len(cold_cache.built) == 7
    cold_cache.library("source3")  # the other process's build lands in the cache
    held.close()
    t.join(timeout=30)
    assert finished.is_set()
    assert cold_cache.compiles["source3"] == 1
