#!/usr/bin/env python3
"""Checks the Apple-only host code on a Linux machine: src/cpp/metal/*.cpp and
the VLLM_METAL_HAS_METAL branch of src/cpp/ops/kernel_primitive.cpp.

Three checks. The first two use the macOS wheel mlx-metal (same version as
the installed mlx), which carries MLX's Metal backend headers, metal-cpp and
the real libmlx.dylib:

1. compile: clang++ -Wall -Wextra -Werror with VLLM_METAL_HAS_METAL=1, as
   -std=c++17 -fsyntax-only and as -std=gnu++20 (what the real build uses,
   MLX's CMake target requires C++20), against those headers plus tiny
   stand-ins for Apple system headers in tools/apple_check/stubs/ (catches
   wrong names, signatures, types, missing includes);
2. symbols: every MLX / metal-cpp symbol the object file needs (functions,
   Objective-C selector variables) must be exported by the wheel's
   libmlx.dylib (catches calls to functions that the headers declare but the
   library does not export, which would only fail at link time on a Mac);
3. behaviour: compiles the source defining run_plan_metal with
   encoder_behaviour.cpp against a recording fake of MLX's Metal device
   (tools/apple_check/fake/) and the installed Linux mlx, and runs it:
   metallib lookup, pipeline names per constant values, input/output
   bindings, args, threadgroup memory, dispatch sizes, error handling.

Usage:
  check_host_code.py [--wheel WHL_OR_DIR] [--source FILE ...] [--cxx CLANG]
                     [--no-symbols] [--no-behaviour] [--fetch-only]

The wheel comes from --wheel or $VLLM_METAL_MLX_METAL_WHEEL (a .whl file, a
directory holding one, or an unpacked wheel), else it is downloaded with pip
into ~/.cache/vllm_metal/mlx-metal (only its headers and libmlx.dylib are
kept, about 26 MB).

Exit status: 0 ok, 1 check failed (clang's diagnostics on stderr), 2 setup
error, 3 the wheel could not be downloaded because the network is unreachable.
"""

from __future__ import annotations

import argparse
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
STUBS = HERE / "stubs"
FAKE = HERE / "fake"
BEHAVIOUR_DRIVER = HERE / "encoder_behaviour.cpp"


def default_sources() -> list[Path]:
    """Files compiled only on Apple, plus files with Apple-only branches."""
    metal = sorted((ROOT / "src/cpp/metal").glob("*.cpp"))
    return metal + [ROOT / "src/cpp/ops/kernel_primitive.cpp"]


def defines_run_plan_metal(src: Path) -> bool:
    return re.search(r"^void run_plan_metal\(", src.read_text(), re.M) is not None
DEFAULT_MLX_VERSION = "0.32.4"
WHEEL_ENV = "VLLM_METAL_MLX_METAL_WHEEL"
EXIT_FAILED, EXIT_SETUP, EXIT_OFFLINE = 1, 2, 3
# Symbols in these namespaces must come from libmlx.dylib (metal-cpp's
# selector and class variables are defined there too).
MLX_NAMESPACES = ("mlx::", "MTL::", "NS::", "CA::", "MTLFX::", "MTL4::")
NETWORK_ERRORS = re.compile(
    r"NewConnectionError|ConnectionError|ConnectTimeout|ReadTimeout|ProxyError|"
    r"Temporary failure in name resolution|Name or service not known|"
    r"Network is unreachable|No route to host|Connection refused|timed out|"
    r"Max retries exceeded|Could not fetch URL",
    re.IGNORECASE,
)


class SetupError(Exception):
    def __init__(self, message: str, code: int = EXIT_SETUP):
        super().__init__(message)
        self.code = code


def mlx_version() -> str:
    try:
        from importlib.metadata import version

        return version("mlx")
    except Exception:
        return DEFAULT_MLX_VERSION


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "vllm_metal" / "mlx-metal"


def find_wheel_file(where: Path, version: str) -> Path | None:
    if where.is_file():
        return where
    found = sorted(where.glob(f"mlx_metal-{version}-*macosx*.whl")) if where.is_dir() else []
    return found[-1] if found else None


def download_wheel(dest: Path, version: str) -> Path:
    dest.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", f"mlx-metal=={version}",
           "--platform", "macosx_15_0_arm64", "--only-binary=:all:", "--no-deps",
           "--retries", "2", "-d", str(dest)]
    print(f"apple_check: downloading mlx-metal=={version} into {dest}", file=sys.stderr)
    proc = subprocess.run(cmd, capture_output=True, text=True)
    wheel = find_wheel_file(dest, version)
    if proc.returncode == 0 and wheel:
        return wheel
    output = proc.stdout + proc.stderr
    offline = bool(NETWORK_ERRORS.search(output))
    why = "network unreachable" if offline else "pip failed"
    raise SetupError(
        f"could not download mlx-metal=={version} ({why}); pass --wheel or set {WHEEL_ENV}.\n"
        f"$ {' '.join(cmd)}\n{output.strip()}",
        EXIT_OFFLINE if offline else EXIT_SETUP)


def unpack(wheel: Path) -> Path:
    """Extracts mlx/include and mlx/lib/libmlx.dylib once; returns the unpacked root."""
    target = cache_dir() / wheel.name[: -len(".whl")]
    if (target / "mlx" / "include" / "metal_cpp").is_dir():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=".unpack-"))
    try:
        with zipfile.ZipFile(wheel) as z:
            members = [n for n in z.namelist()
                       if n.startswith("mlx/include/") or n == "mlx/lib/libmlx.dylib"]
            if not any(n.startswith("mlx/include/metal_cpp/") for n in members):
                raise SetupError(f"{wheel} has no mlx/include/metal_cpp: not an mlx-metal wheel?")
            z.extractall(tmp, members)
        try:
            tmp.rename(target)
        except OSError:  # another process unpacked it first
            if not (target / "mlx" / "include" / "metal_cpp").is_dir():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def locate_mlx_metal(arg: str | None, version: str) -> Path:
    """Returns a directory containing mlx/include/{mlx,metal_cpp} and mlx/lib/libmlx.dylib."""
    given = arg or os.environ.get(WHEEL_ENV)
    if given:
        path = Path(given).expanduser()
        if (path / "mlx" / "include" / "metal_cpp").is_dir():
            return path
        wheel = find_wheel_file(path, version)
        if not wheel:
            raise SetupError(f"{path}: no mlx_metal-{version} wheel or unpacked wheel there")
        return unpack(wheel)
    for unpacked in sorted(cache_dir().glob(f"mlx_metal-{version}-*macosx*")):
        if (unpacked / "mlx" / "include" / "metal_cpp").is_dir():
            return unpacked
    wheel = find_wheel_file(cache_dir(), version)
    if wheel:
        return unpack(wheel)
    wheel = download_wheel(cache_dir(), version)
    root = unpack(wheel)
    wheel.unlink()  # 45 MB, mostly MLX's own metallib; the unpacked part is enough
    return root


def find_tool(explicit: str | None, candidates: list[str], what: str) -> str:
    for name in ([explicit] if explicit else []) + candidates:
        if name and shutil.which(name):
            return shutil.which(name)
    raise SetupError(f"no {what} found (tried {', '.join(c for c in candidates if c)})")


def compile_flags(mlx_root: Path) -> list[str]:
    include = mlx_root / "mlx" / "include"
    # Deprecation warnings stay warnings: libstdc++ in C++20 mode deprecates
    # std::result_of, which MLX's CPU encoder reaches through std::bind.
    flags = ["-DVLLM_METAL_HAS_METAL=1",
             "-Wall", "-Wextra", "-Wno-unused-parameter", "-Werror",
             "-Wno-error=deprecated-declarations",
             f"-I{ROOT / 'src' / 'cpp'}", f"-I{ROOT / 'src' / 'metal'}",
             "-isystem", str(include / "metal_cpp"), "-isystem", str(include)]
    if platform.system() != "Darwin":  # on a Mac the SDK's real headers are used
        flags = ["-fblocks", "-isystem", str(STUBS)] + flags
    return flags


def start(cmd: list[str]) -> subprocess.Popen:
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def run(cmd: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True)


def normalize(symbol: str) -> str:
    """Demangled name with libc++/libstdc++ and LP64 spelling differences removed."""
    s = symbol.replace("std::__1::", "std::").replace("std::__cxx11::", "std::")
    return re.sub(r"\blong long\b", "long", s)


def exported_symbols(nm: str, dylib: Path) -> set[str]:
    proc = run([nm, "-g", "--defined-only", "-C", str(dylib)])
    if proc.returncode != 0:
        raise SetupError(f"{nm} could not read {dylib}:\n{proc.stderr}")
    return {normalize(line.split(" ", 2)[2]) for line in proc.stdout.splitlines()
            if line.count(" ") >= 2}


def needed_mlx_symbols(nm: str, obj: Path) -> list[str]:
    proc = run([nm, "-u", "-C", str(obj)])
    if proc.returncode != 0:
        raise SetupError(f"{nm} could not read {obj}:\n{proc.stderr}")
    needed = []
    for line in proc.stdout.splitlines():
        name = line.strip().split(" ", 1)[-1].strip()
        bare = re.sub(r"^(vtable|typeinfo|typeinfo name|VTT) for ", "", name)
        if bare.startswith(MLX_NAMESPACES):
            needed.append(name)
    return needed


def check_source(src: Path, cxx: str, nm: str | None, mlx_root: Path,
                 exports: set[str] | None) -> list[str]:
    """Returns a list of failure reports (empty when the file passes).

    Compiles twice, concurrently: -fsyntax-only as C++17 (the project's
    standard) and as an object file with -std=gnu++20, which is what the real
    build uses because MLX's CMake target requires cxx_std_20. The object's
    undefined symbols are then looked up in libmlx.dylib (-O0: every inline
    header function used is emitted, so its references are seen too).
    """
    flags = compile_flags(mlx_root)
    with tempfile.TemporaryDirectory() as tmp:
        obj = Path(tmp) / (src.stem + ".o")
        jobs = {"-std=c++17 -fsyntax-only": start([cxx, "-std=c++17", "-fsyntax-only", *flags,
                                                   str(src)])}
        if nm is not None and exports is not None:
            jobs["-std=gnu++20 -c"] = start([cxx, "-std=gnu++20", "-c", "-O0", *flags,
                                             "-o", str(obj), str(src)])
        failures = []
        for mode, proc in jobs.items():
            _, err = proc.communicate()
            if proc.returncode != 0:
                failures.append(f"{src}: clang++ {mode} failed:\n{err.strip()}")
        if failures or len(jobs) == 1:
            return failures
        missing = [s for s in needed_mlx_symbols(nm, obj) if normalize(s) not in exports]
    if missing:
        return [f"{src}: uses symbols that libmlx.dylib does not export "
                "(declared in headers, not MLX_API, or wrong signature):\n  "
                + "\n  ".join(missing)]
    return []


def installed_mlx() -> Path:
    """The installed (Linux) mlx package directory: include/ and lib/libmlx.*."""
    import importlib.util

    spec = importlib.util.find_spec("mlx")
    if spec is None or not spec.submodule_search_locations:
        raise SetupError("the behaviour check needs the mlx package installed (or --no-behaviour)")
    root = Path(list(spec.submodule_search_locations)[0])
    if not (root / "include" / "mlx" / "array.h").is_file():
        raise SetupError(f"{root}: mlx has no include/ directory")
    return root


def start_behaviour_build(sources: list[Path], cxx: str, mlx: Path, out: Path) -> subprocess.Popen:
    lib = mlx / "lib"
    cmd = [cxx, "-std=gnu++20", "-O0", "-DVLLM_METAL_HAS_METAL=1",
           "-Wall", "-Wextra", "-Wno-unused-parameter", "-Werror",
           "-Wno-error=deprecated-declarations",
           f"-I{FAKE}",  # before MLX's include dir: its fake mlx/backend/metal/device.h wins
           f"-I{ROOT / 'src' / 'cpp'}", f"-I{ROOT / 'src' / 'metal'}",
           "-isystem", str(mlx / "include"),
           *map(str, sources), str(BEHAVIOUR_DRIVER), str(ROOT / "src/cpp/ops/kernel_launch.cpp"),
           f"-L{lib}", "-lmlx", f"-Wl,-rpath,{lib}", "-o", str(out)]
    return start(cmd)


def finish_behaviour(build: subprocess.Popen, exe: Path) -> list[str]:
    _, err = build.communicate()
    if build.returncode != 0:
        return [f"behaviour check: building against the fake Metal device failed:\n{err.strip()}"]
    failures = []
    for layout in ("installed", "build-tree"):
        proc = run([str(exe), layout])
        if proc.returncode != 0:
            failures.append(f"behaviour check ({layout} layout) failed:\n"
                            f"{(proc.stdout + proc.stderr).strip()}")
    return failures


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--wheel", help=f"mlx-metal wheel, directory, or unpacked wheel (${WHEEL_ENV})")
    ap.add_argument("--source", nargs="+", type=Path,
                    help="files to check (default: src/cpp/metal/*.cpp and "
                    "src/cpp/ops/kernel_primitive.cpp, whose eval_gpu is Apple-only)")
    ap.add_argument("--cxx", help="clang++ to use (default: $MSLEMU_CXX, clang++-19, clang++)")
    ap.add_argument("--no-symbols", action="store_true", help="skip the libmlx.dylib symbol check")
    ap.add_argument("--no-behaviour", action="store_true", help="skip the fake-device run")
    ap.add_argument("--mlx-version", default=None, help="default: the installed mlx's version")
    ap.add_argument("--fetch-only", action="store_true",
                    help="only locate (or download) and unpack the wheel; print its directory")
    args = ap.parse_args(argv)

    version = args.mlx_version or mlx_version()
    sources = [Path(s) for s in args.source or default_sources()]
    try:
        if not sources:
            raise SetupError("no sources to check")
        for s in sources:
            if not s.is_file():
                raise SetupError(f"{s}: no such file")
        mlx_root = locate_mlx_metal(args.wheel, version)
        if args.fetch_only:
            print(mlx_root)
            return 0
        cxx = find_tool(args.cxx, [os.environ.get("MSLEMU_CXX", ""), "clang++-19", "clang++"],
                        "clang++")
        nm, exports = None, None
        if not args.no_symbols:
            nm = find_tool(None, ["llvm-nm-19", "llvm-nm"], "llvm-nm")
            exports = exported_symbols(nm, mlx_root / "mlx" / "lib" / "libmlx.dylib")
        linux_mlx = None if args.no_behaviour else installed_mlx()
    except SetupError as e:
        print(f"apple_check: {e}", file=sys.stderr)
        return e.code

    failures = []
    with tempfile.TemporaryDirectory() as tmp:
        exe = Path(tmp) / "encoder_behaviour"
        # The slowest compile starts first and runs alongside the others.
        encoders = [s for s in sources if defines_run_plan_metal(s)]
        build = None
        if linux_mlx is not None and not encoders:
            failures.append("behaviour check: no source defines run_plan_metal")
        elif linux_mlx is not None:
            build = start_behaviour_build(encoders, cxx, linux_mlx, exe)
        for src in sources:
            failures += check_source(src, cxx, nm, mlx_root, exports)
        if build is not None:
            failures += finish_behaviour(build, exe)
    if failures:
        print("\n\n".join(failures), file=sys.stderr)
        return EXIT_FAILED
    checks = ["compile"] + ([] if args.no_symbols else ["libmlx.dylib symbols"]) + (
        [] if args.no_behaviour else ["behaviour"])
    names = [str(s.resolve().relative_to(ROOT)) if s.resolve().is_relative_to(ROOT) else str(s)
             for s in sources]
    print(f"apple_check: OK ({' + '.join(checks)}; mlx-metal {version}): {', '.join(names)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
