"""The macOS wheel, checked without a Mac: its tag, and its file list from a dry run of the
Apple build configuration.

CMake configures this project as if on macOS (a toolchain file sets CMAKE_SYSTEM_NAME Darwin,
so every `if(APPLE)` branch is taken); a recording `xcrun` stands in for the Metal compiler
and builds the metallib target, a recording `install_name_tool` for the rpath edits, and
`cmake --install` lays the tree out as the wheel holds it (scikit-build-core installs into
the wheel's platlib). What this does not check: that Apple's tools accept these commands.
"""

import json
import os
import subprocess
import sys
import textwrap
import tomllib
from pathlib import Path

import mlx
import pytest

ROOT = Path(__file__).resolve().parents[2]
KERNELS = sorted(p.stem for p in (ROOT / "src" / "metal").glob("*.metal"))

TOOLCHAIN = """\
set(CMAKE_SYSTEM_NAME Darwin)
set(CMAKE_SYSTEM_PROCESSOR arm64)
set(CMAKE_CXX_COMPILER_WORKS TRUE)
"""

# Records each call as a JSON line; `-c X -o Y` writes an .air file, `-o Z.metallib` the
# library (Metal's MTLB magic, then the inputs' names). Calls that are not the Metal
# compiler's (CMake asking for the SDK) go to the real xcrun where there is one (a Mac).
FAKE_XCRUN = """\
#!{python}
import json, os, sys
args = sys.argv[1:]
with open(os.environ["FAKE_TOOL_LOG"], "a") as log:
    log.write(json.dumps(["xcrun", *args]) + "\\n")
if "metal" not in args and os.path.exists("/usr/bin/xcrun"):
    os.execv("/usr/bin/xcrun", ["/usr/bin/xcrun", *args])
if "-o" in args:
    out = args[args.index("-o") + 1]
    inputs = [a for a in args if a.endswith((".air", ".metal"))]
    with open(out, "wb") as f:
        f.write((b"MTLB" if out.endswith(".metallib") else b"AIR ") + " ".join(inputs).encode())
"""

FAKE_INSTALL_NAME_TOOL = """\
#!{python}
import json, os, sys
with open(os.environ["FAKE_TOOL_LOG"], "a") as log:
    log.write(json.dumps(["install_name_tool", *sys.argv[1:]]) + "\\n")
"""


def darwin_cmake_defines() -> dict[str, str]:
    """cmake.define of pyproject's overrides for macOS (what scikit-build-core passes there)."""
    tool = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["scikit-build"]
    defines = dict(tool.get("cmake", {}).get("define", {}))
    for override in tool.get("overrides", []):
        if override.get("if", {}).get("platform-system") == "darwin":
            defines.update(override.get("cmake", {}).get("define", {}))
    return defines


def _write_tool(path: Path, text: str) -> Path:
    path.write_text(text.format(python=sys.executable))
    path.chmod(0o755)
    return path


@pytest.fixture(scope="module")
def apple_install(tmp_path_factory):
    """(install root, tool calls, build dir) of the dry-run Apple build."""
    tmp = tmp_path_factory.mktemp("apple")
    tools = tmp / "bin"
    tools.mkdir()
    _write_tool(tools / "xcrun", FAKE_XCRUN)
    install_name_tool = _write_tool(tools / "install_name_tool", FAKE_INSTALL_NAME_TOOL)
    (tmp / "darwin.cmake").write_text(TOOLCHAIN)
    log = tmp / "tools.jsonl"
    env = {**os.environ, "PATH": f"{tools}:{Path(sys.executable).parent}:{os.environ['PATH']}",
           "FAKE_TOOL_LOG": str(log)}
    build = tmp / "build"
    defines = {**darwin_cmake_defines(),
               "CMAKE_TOOLCHAIN_FILE": str(tmp / "darwin.cmake"),
               "Python_EXECUTABLE": sys.executable,
               "CMAKE_INSTALL_NAME_TOOL": str(install_name_tool),
               "CMAKE_HAVE_LIBC_PTHREAD": "1"}  # no try-compile for Darwin on Linux
    cmake = [sys.executable, "-m", "cmake"] if not (Path(sys.executable).parent / "cmake").exists() \
        else [str(Path(sys.executable).parent / "cmake")]
    run = lambda *a: subprocess.run(a, env=env, capture_output=True, text=True)  # noqa: E731
    r = run(*cmake, "-S", str(ROOT), "-B", str(build), "-G", "Ninja",
            *[f"-D{k}={v}" for k, v in defines.items()])
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    r = run(*cmake, "--build", str(build), "--target", "vllm_metal_metallib")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    # The C++ targets cannot be built for macOS here: stand-ins for the files install needs.
    for line in (build / "cmake_install.cmake").read_text().splitlines():
        if "TYPE SHARED_LIBRARY FILES" in line or "TYPE MODULE FILES" in line:
            Path(line.split('FILES "')[1].split('"')[0]).touch()
    root = tmp / "platlib"
    r = run(*cmake, "--install", str(build), "--prefix", str(root))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    calls = [json.loads(line) for line in log.read_text().splitlines()]
    return root, calls, build


def test_metallib_target_compiles_every_kernel_and_links_one_library(apple_install):
    _, calls, build = apple_install
    # the Metal compiler's calls (CMake's Darwin platform also asks xcrun for the SDK)
    xcrun = [c[1:] for c in calls if c[0] == "xcrun" and "metal" in c]
    compiled = sorted(Path(a[a.index("-c") + 1]).stem for a in xcrun if "-c" in a)
    assert compiled == KERNELS
    (link,) = [a for a in xcrun if "-c" not in a]
    assert Path(link[link.index("-o") + 1]) == build / "metallib" / "vllm_metal.metallib"
    assert sorted(a for a in link if a.endswith(".air")) == sorted(
        a[a.index("-o") + 1] for a in xcrun if "-c" in a)
    # one minimum macOS for the kernels, the host code and the wheel tag
    target = darwin_cmake_defines()["CMAKE_OSX_DEPLOYMENT_TARGET"]
    for a in xcrun:
        assert f"-mmacosx-version-min={target}" in a, a


def test_wheel_holds_the_metallib_next_to_the_core_library(apple_install):
    root, _, build = apple_install
    lib = root / "vllm_metal" / "lib"
    metallib = lib / "vllm_metal.metallib"
    # the library the metallib target built, where encoder.cpp looks first
    # (<dir of libvllm_metal_core>/vllm_metal.metallib) and the doctor checks
    assert metallib.read_bytes() == (build / "metallib" / "vllm_metal.metallib").read_bytes()
    assert metallib.read_bytes().startswith(b"MTLB")
    assert (lib / "libvllm_metal_core.dylib").is_file()
    (core,) = (root / "vllm_metal").glob("_core.*")
    assert core.suffix == ".so"  # Python's extension suffix, also on macOS
    assert sorted(p.stem for p in (root / "vllm_metal" / "_metal").glob("*.metal")) == KERNELS
    assert (root / "vllm_metal" / "_mslemu" / "mslemu" / "__init__.py").is_file()
    assert not list(root.rglob("*.so")) or all(p.name.startswith("_core") for p in root.rglob("*.so"))


def test_rpaths_resolve_inside_an_installed_environment(apple_install):
    root, calls, _ = apple_install
    rpaths = {}
    for c in calls:
        if c[0] == "install_name_tool":
            added = [c[i + 1] for i, a in enumerate(c) if a == "-add_rpath"]
            rpaths[Path(c[-1]).relative_to(root).as_posix()] = added
    core = next(k for k in rpaths if k.startswith("vllm_metal/_core"))
    assert rpaths[core] == ["@loader_path/lib", "@loader_path/../mlx/lib"]
    assert rpaths["vllm_metal/lib/libvllm_metal_core.dylib"] == ["@loader_path", "@loader_path/../../mlx/lib"]
    # @loader_path/lib from _core is the core library's directory; ../mlx/lib from the
    # package is MLX's library directory in site-packages (as the MLX wheel lays it out)
    assert (root / "vllm_metal" / "lib" / "libvllm_metal_core.dylib").is_file()
    mlx_lib = Path(mlx.__path__[0]) / "lib"
    assert any(p.name.startswith("libmlx") for p in mlx_lib.iterdir())
    assert (root / "vllm_metal" / "lib" / "../../mlx/lib").resolve() == (root / "mlx" / "lib").resolve()


TAG_SCRIPT = textwrap.dedent("""
    import platform, sys, sysconfig
    sysconfig.get_config_vars()  # this interpreter's values, before it is told it is a Mac
    sys.platform = "darwin"
    platform.system = lambda: "Darwin"
    platform.machine = lambda: "arm64"
    platform.mac_ver = lambda: ("15.5", ("", "", ""), "arm64")
    from scikit_build_core.build.common_wheel_helpers import get_wheel_tag
    from scikit_build_core.settings.skbuild_read_settings import SettingsReader
    settings = SettingsReader.from_file(sys.argv[1], state="wheel").settings
    print(get_wheel_tag(settings, targetlib="platlib"))
""")


def test_wheel_tag_on_an_apple_silicon_mac_is_macos_14_arm64():
    # scikit-build-core's own tag logic, on pyproject's settings, on a (patched) macOS 15 arm64:
    # macOS 14 is the floor of the metallib (Metal 3.1) and of MLX 0.32.4's macOS wheels
    r = subprocess.run([sys.executable, "-c", TAG_SCRIPT, str(ROOT / "pyproject.toml")],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.strip().endswith("-macosx_14_0_arm64"), r.stdout


# ---- the workflow and the documented install -----------------------------------------------

WORKFLOW = ROOT / ".github" / "workflows" / "macos.yml"


def _commands(script: str) -> list[str]:
    return [line.strip() for line in script.splitlines()
            if line.strip() and not line.strip().startswith("#")]


def documented_install_commands() -> list[str]:
    """The block after the install-on-mac marker of docs/apple.md."""
    text = (ROOT / "docs" / "apple.md").read_text()
    block = text.split("<!-- install-on-mac", 1)[1].split("```sh\n", 1)[1].split("```", 1)[0]
    return _commands(block)


def test_wheel_job_runs_the_documented_install_then_checks_the_wheel_and_serves():
    import yaml

    job = yaml.safe_load(WORKFLOW.read_text())["jobs"]["wheel"]
    assert job["runs-on"] == "macos-15"  # Apple silicon
    runs = [step.get("run", "") for step in job["steps"]]
    documented = documented_install_commands()
    assert "pip wheel . --no-deps -w dist" in documented
    (install,) = [i for i, run in enumerate(runs) if documented[0] in run]
    assert _commands(runs[install]) == documented
    later = "\n".join(runs[install + 1:])
    assert "dist/vllm_metal-*-macosx_*_arm64.whl" in later
    assert '"vllm_metal/lib/vllm_metal.metallib"' in later
    (doctor,) = [run for run in runs[install + 1:] if "-m vllm_metal.doctor" in run]
    assert "--skip-serve" not in doctor  # the serve smoke test runs on the Mac


def _actionlint(path: Path) -> subprocess.CompletedProcess:
    bindir = Path(sys.executable).parent
    for tool in ("actionlint", "shellcheck"):  # scripts/setup installs both from PyPI
        assert (bindir / tool).exists(), f"{tool} missing from {bindir}: run scripts/setup"
    return subprocess.run([str(bindir / "actionlint"), "-shellcheck", str(bindir / "shellcheck"),
                           "-no-color", str(path)], capture_output=True, text=True)


def test_workflow_passes_actionlint_and_shellcheck():
    r = _actionlint(WORKFLOW)
    assert r.returncode == 0, r.stdout + r.stderr


def test_actionlint_catches_a_broken_workflow(tmp_path):
    broken = tmp_path / "macos.yml"
    text = WORKFLOW.read_text()
    broken.write_text(text.replace("${{ runner.temp }}", "${{ runner.tmp }}", 1)
                      .replace("test -f build/dev/metallib/vllm_metal.metallib",
                               "test -f $UNQUOTED/vllm_metal.metallib", 1))
    r = _actionlint(broken)
    assert r.returncode != 0
    assert "runner.tmp" in r.stdout or "tmp" in r.stdout
    assert "SC2086" in r.stdout  # shellcheck ran on the run: scripts
