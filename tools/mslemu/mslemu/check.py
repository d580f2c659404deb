"""mslemu.check: syntax + type check of .metal files on Linux (no Apple tools).

    python -m mslemu.check [--strict] [-DNAME=V ...] [-IDIR ...] kernels/*.metal

Runs the generator (preprocess + rewrites + launcher) and `clang++ -fsyntax-only`
over the result.  Catches C++/MSL syntax errors, type errors, wrong overloads,
bad vector constructors (component count), writes through `constant` pointers,
bad kernel-parameter attributes, template instantiation errors.  Does NOT
catch Metal-only rules (address-space mismatches between device/threadgroup
pointers, MSL's ban on recursion/double/exceptions, resource limits).
--strict adds -Werror plus -Wdouble-promotion (Metal has no double).
"""
import os
import subprocess
import sys
import tempfile

from . import gen

CHECK_FLAGS = ["-std=c++17", "-fsyntax-only", "-Xclang", "-ffloat16-excess-precision=none",
               "-Wall", "-Wno-unknown-attributes", "-Wno-duplicate-decl-specifier", "-Wno-unused-variable",
               "-Wno-c99-designator", "-Wno-unused-function"]
STRICT_FLAGS = ["-Werror", "-Wdouble-promotion"]


def check_files(paths, include_dirs=(), defines=(), strict=True, cxx=None):
    """Type-check each .metal file; return [(path, ok, stderr)] in input order."""
    if isinstance(paths, (str, os.PathLike)):
        paths = [paths]
    cxx = cxx or gen.find_cxx()
    defs = gen.define_flags(defines)
    incs = [os.path.abspath(d) for d in include_dirs]
    results = []
    for path in paths:
        path = os.fspath(path)
        with tempfile.TemporaryDirectory(prefix="mslemu-check-") as td:
            try:
                glue, _ = gen.generate(path, td, incs, defs, cxx)
            except (gen.GenerateError, OSError) as e:
                results.append((path, False, "generator error: %s\n" % e))
                continue
            cmd = ([cxx] + CHECK_FLAGS + ["-I", gen.INCLUDE_DIR, "-I", os.path.dirname(os.path.abspath(path))]
                   + defs + ["-I" + i for i in incs] + (STRICT_FLAGS if strict else []) + [glue])
            r = subprocess.run(cmd, capture_output=True, text=True)
            results.append((path, r.returncode == 0, r.stderr))
    return results


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    files = [a for a in argv if not a.startswith("-")]
    defs = [a for a in argv if a.startswith("-D")]
    incs = [a[2:] for a in argv if a.startswith("-I")]
    unknown = [a for a in argv if a.startswith("-") and not a.startswith(("-D", "-I")) and a != "--strict"]
    if unknown or not files:
        print("usage: python -m mslemu.check [--strict] [-DNAME=V ...] [-IDIR ...] FILE.metal ...", file=sys.stderr)
        return 2
    bad = 0
    for path, ok, err in check_files(files, incs, defs, strict="--strict" in argv):
        sys.stderr.write(err)
        print("%s: %s" % (path, "OK" if ok else "FAILED"))
        bad += not ok
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
