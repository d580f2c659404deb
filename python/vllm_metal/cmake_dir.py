"""Where the installed CMake package lives, for native apps:

    cmake -DVllmMetal_DIR=$(python -m vllm_metal.cmake_dir) ...
"""

from pathlib import Path


def cmake_dir() -> Path:
    import vllm_metal._core as core

    return Path(core.__file__).resolve().parent / "share" / "cmake" / "VllmMetal"


if __name__ == "__main__":
    print(cmake_dir())
