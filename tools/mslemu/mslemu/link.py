"""mslemu.link: link several .metal files into ONE library, as the metallib build does.

On Apple every src/metal/*.metal is compiled to AIR on its own and all are linked into
one vllm_metal.metallib, so two files that define the same external symbol (a
program-scope `constant` table without `static`, a non-inline function in a shared
header) or the same kernel host name cannot coexist.  A single-file emulator build never
sees that.  Here each file is compiled by the emulator's clang as a separate translation
unit (the generator keeps MSL's linkage rules, see gen.program_scope_external_constants)
and the objects are linked into one shared object; every kernel host name also becomes a
strong symbol, so a name defined twice fails the link like a duplicate table does.

    python -m mslemu.link [-IDIR] [-DNAME=V] a.metal b.metal ...
"""
import os
import subprocess
import sys
import tempfile

from . import gen

FLAGS = ["-std=c++17", "-fPIC", "-O0", "-fvisibility=hidden", "-Xclang", "-ffloat16-excess-precision=none",
         "-Wno-unknown-attributes", "-Wno-unused-parameter", "-Wno-duplicate-decl-specifier"]


class LinkError(RuntimeError):
    """The files do not link into one library (duplicate symbols or kernel names)."""


def _unit(metal_path, outdir, include_dirs, defines, cxx):
    """Write OUTDIR/<stem>/unit.cpp: the rewritten kernel source plus one strong symbol
    per kernel host name (no launcher: the launcher's C ABI is per-library)."""
    d = os.path.join(outdir, os.path.splitext(os.path.basename(metal_path))[0])
    _, meta = gen.generate(metal_path, d, include_dirs, defines, cxx)
    ii = os.path.basename(metal_path) + ".ii"
    lines = ["#include <mslemu/metal_cpu_shim.h>", '#include "%s"' % ii, "#include <mslemu/end.h>"]
    for i, host in enumerate(sorted(meta)):
        # asm label: the host name itself is the symbol, whatever characters it has
        lines.append('extern "C" __attribute__((used)) const char mslemu_host_%d[] __asm__("metal.kernel.%s") = "%s";'
                     % (i, host, host))
    unit = os.path.join(d, "unit.cpp")
    with open(unit, "w") as f:
        f.write("\n".join(lines) + "\n")
    return unit, sorted(meta)


def link(metal_paths, include_dirs=(), defines=(), cxx=None, workdir=None):
    """Compile each file as its own translation unit and link all into one shared
    object.  Returns {path: [kernel host names]}; raises LinkError with the linker's
    message on a duplicate symbol, gen.GenerateError / LinkError on a file that does not
    compile."""
    cxx = cxx or gen.find_cxx()
    defs = gen.define_flags(defines)
    incs = [os.path.abspath(x) for x in include_dirs]
    with tempfile.TemporaryDirectory(prefix="mslemu-link-", dir=workdir) as tmp:
        objs, names = [], {}
        for p in metal_paths:
            p = os.path.abspath(p)
            unit, hosts = _unit(p, tmp, incs, defs, cxx)
            names[p] = hosts
            obj = unit[:-4] + ".o"
            cmd = [cxx] + FLAGS + ["-I", gen.INCLUDE_DIR, "-I", os.path.dirname(p)]
            for x in incs:
                cmd += ["-I", x]
            cmd += defs + ["-c", unit, "-o", obj]
            r = subprocess.run(cmd, capture_output=True, text=True)
            if r.returncode != 0:
                raise LinkError("[mslemu] compiling %s failed:\n%s" % (p, r.stderr))
            objs.append(obj)
        out = os.path.join(tmp, "library.so")
        r = subprocess.run([cxx, "-shared", "-o", out] + objs, capture_output=True, text=True)
        if r.returncode != 0:
            raise LinkError("[mslemu] %d .metal files do not link into one library:\n%s"
                            % (len(objs), r.stderr.replace(tmp + os.sep, "")))
    return names


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    paths = [a for a in argv if not a.startswith(("-D", "-I"))]
    if not paths:
        print("usage: python -m mslemu.link [-IDIR] [-DNAME=V] a.metal b.metal ...", file=sys.stderr)
        return 2
    try:
        names = link(paths, [a[2:] for a in argv if a.startswith("-I")], [a for a in argv if a.startswith("-D")])
    except (LinkError, gen.GenerateError) as e:
        print(e, file=sys.stderr)
        return 1
    print("%d files, %d kernels: one library" % (len(names), sum(len(v) for v in names.values())))
    return 0


if __name__ == "__main__":
    sys.exit(main())
