"""Emulator throughput on the sample kernels (not a test).

    .venv/bin/python tools/mslemu/bench.py [-O2|-O1|...]

Prints simulated GPU threads per second for a barrier-heavy kernel (softmax, 256-thread
threadgroups) and a sync-free one (Q4_0 dequantisation), with 1 and 2 worker threads.
"""
import ctypes
import os
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import mslemu  # noqa: E402

KDIR = os.path.join(HERE, "kernels")


class SoftmaxArgs(ctypes.Structure):
    _fields_ = [("ncols", ctypes.c_uint32), ("scale", ctypes.c_float)]


Q4_0 = np.dtype([("d", "<f2"), ("qs", "u1", (16,))])


def softmax_ref(x, scale):
    z = x.astype(np.float64) * scale
    z -= z.max(axis=1, keepdims=True)
    e = np.exp(z)
    return e / e.sum(axis=1, keepdims=True)


def best_of(fn, reps=3):
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def main(opt):
    t0 = time.perf_counter()
    lib = mslemu.Library(os.path.join(KDIR, "softmax.metal"), opt=opt)
    print("build (cached or fresh) %.2fs  %s" % (time.perf_counter() - t0, lib.so_path))
    rng = np.random.default_rng(0)
    rows, tg = 4096, 256
    for cols in (256, 1024, 4096):
        x = rng.standard_normal((rows, cols)).astype(np.float32)
        y = np.zeros_like(x)
        for workers in (1, 2):
            t = best_of(lambda: lib.dispatch_threadgroups("softmax_f32", grid=(rows,), tg=(tg,),
                                                          buffers=[x, y, SoftmaxArgs(cols, 1.0)], workers=workers))
            n = rows * tg
            print("softmax_f32 %dx%d tg=%d workers=%d: %.3fs  %.2f M threads/s  %.1f ns/thread  (%.0f Melem/s)"
                  % (rows, cols, tg, workers, t, n / t / 1e6, t / n * 1e9, rows * cols / t / 1e6))
        assert np.abs(y - softmax_ref(x, 1.0)).max() < 1e-6
    t = best_of(lambda: softmax_ref(x, 1.0))
    print("numpy float64 reference %dx%d: %.3fs" % (rows, cols, t))
    x16 = x.astype(np.float16)
    y16 = np.zeros_like(x16)
    t = best_of(lambda: lib.dispatch_threadgroups("softmax_f16x4", grid=(rows,), tg=(tg,),
                                                  buffers=[x16, y16, SoftmaxArgs(cols, 1.0)],
                                                  threadgroup_memory=[32 * 4]))
    print("softmax_f16x4 %dx%d tg=%d: %.3fs  %.2f M threads/s" % (rows, cols, tg, t, rows * tg / t / 1e6))

    libq = mslemu.Library(os.path.join(KDIR, "q4_0.metal"), opt=opt)
    nb = 1 << 16
    blocks = np.zeros(nb, dtype=Q4_0)
    blocks["d"] = (rng.standard_normal(nb) * 0.05).astype(np.float16)
    blocks["qs"] = rng.integers(0, 256, size=(nb, 16), dtype=np.uint8)
    yq = np.zeros(nb * 32, np.float32)
    t = best_of(lambda: libq.dispatch_threads("dequantize_q4_0_f32", threads=(nb,), tg=(256,),
                                              buffers=[blocks, yq, np.uint32(nb)]))
    print("dequantize_q4_0_f32 %d blocks (1 thread/block, no sync): %.3fs  %.2f M threads/s  %.1f ns/thread"
          % (nb, t, nb / t / 1e6, t / nb * 1e9))
    t = best_of(lambda: libq.dispatch_threads("dequantize_q4_0_t_f32", threads=(nb * 4,), tg=(256,),
                                              buffers=[blocks.view(np.uint8), yq, np.uint32(nb)]))
    print("dequantize_q4_0_t_f32 %d threads: %.3fs  %.2f M threads/s" % (nb * 4, t, nb * 4 / t / 1e6))


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "-O2")
