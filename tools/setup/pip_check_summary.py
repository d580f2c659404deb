"""`pip check` in one line: what vLLM asks for and we skip on purpose, by name.

scripts/setup installs vLLM without its GPU stack, so `pip check` always lists CUDA
packages as missing. Those named in requirements/vllm-gpu-only.txt (with the reason)
are summarised on one line; any other problem is printed in full, as a warning.

    python tools/setup/pip_check_summary.py requirements/vllm-gpu-only.txt
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

# "vllm 0.33.0 requires flashinfer-python, which is not installed."
_MISSING = re.compile(r"^\S+ \S+ requires (?P<name>[A-Za-z0-9_.\-]+)")
# "vllm 0.33.0 has requirement torch==2.14.0, but you have torch 2.13.0+cpu."
_MISMATCH = re.compile(r"^\S+ \S+ has requirement (?P<name>[A-Za-z0-9_.\-]+)(?P<spec>\S*), "
                       r"but you have \S+ (?P<have>\S+?)\.?$")


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def expected_names(path: Path) -> set[str]:
    names = set()
    for line in path.read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            names.add(canonical(line.split("|", 1)[0].strip()))
    return names


def classify(report: str, expected: set[str]) -> tuple[list[str], list[str], list[str]]:
    """(expected missing names, expected "name version (wanted spec)", other lines)."""
    missing, versions, other = [], [], []
    for line in report.splitlines():
        if not line.strip() or line.startswith("No broken requirements"):
            continue
        if (m := _MISSING.match(line)) and canonical(m.group("name")) in expected:
            if canonical(m.group("name")) not in missing:
                missing.append(canonical(m.group("name")))
        elif (m := _MISMATCH.match(line)) and canonical(m.group("name")) in expected:
            versions.append(f"{m.group('name')} {m.group('have')} (asked: {m.group('spec')})")
        else:
            other.append(line)
    return missing, versions, other


def main() -> int:
    expected = expected_names(Path(sys.argv[1]))
    r = subprocess.run([sys.executable, "-m", "pip", "check"], capture_output=True, text=True)
    missing, versions, other = classify(r.stdout + r.stderr, expected)
    why = os.path.relpath(sys.argv[1])
    if missing:
        print(f"setup: not installed on purpose (GPU-only or unused; {why} says why): "
              + ", ".join(sorted(missing)))
    if versions:
        print(f"setup: other versions on purpose ({why}): " + ", ".join(versions))
    for line in other:
        print(f"setup: warning: pip check: {line}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
