"""mslemu: run Metal Shading Language compute kernels on a Linux CPU.

    import mslemu
    lib = mslemu.Library("kernels/softmax.metal")          # build (cached) + load
    lib.dispatch_threadgroups("softmax_f32", grid=(rows,), tg=(256,), buffers=[x, y, args])
    results = mslemu.check_files(["kernels/softmax.metal"])  # [(path, ok, stderr)]

See tools/mslemu/README.md.  Everything but the toolchain is imported lazily: Library needs
numpy (the generator and the type check do not), and `python -m mslemu.check` /
`python -m mslemu.gen` must not find their module already imported.
"""
from .toolchain import INCLUDE_DIR, ROOT, find_cxx

__all__ = ["Library", "BuildError", "GenerateError", "check_files", "find_cxx", "default_cache_dir",
           "ROOT", "INCLUDE_DIR"]


def __getattr__(name):
    if name == "check_files":
        from .check import check_files
        return check_files
    if name == "GenerateError":
        from .gen import GenerateError
        return GenerateError
    if name in ("Library", "BuildError", "default_cache_dir"):
        from . import library
        return getattr(library, name)
    raise AttributeError("module 'mslemu' has no attribute %r" % name)
