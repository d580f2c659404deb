import re
from pathlib import Path

import pytest

from vllm_metal import envs

DOC = Path(__file__).resolve().parents[2] / "docs" / "environment.md"


def test_every_variable_is_documented_and_every_documented_one_exists():
    documented = set(re.findall(r"`(VLLM_(?:METAL_)?[A-Z0-9_]+)`", DOC.read_text()))
    assert documented == set(envs.ENVIRONMENT)


def test_parsing_and_defaults(monkeypatch):
    monkeypatch.delenv("VLLM_METAL_KERNELS", raising=False)
    assert envs.VLLM_METAL_KERNELS == "native"
    monkeypatch.setenv("VLLM_METAL_KERNELS", "Emulated")
    assert envs.VLLM_METAL_KERNELS == "emulated"
    monkeypatch.setenv("VLLM_METAL_DISABLE", "yes")
    assert envs.VLLM_METAL_DISABLE is True


@pytest.mark.parametrize("name, value", [("VLLM_METAL_KERNELS", "gpu"), ("VLLM_METAL_DISABLE", "maybe"),
                                         ("VLLM_METAL_NUM_THREADS", "many")])
def test_bad_values_name_the_variable(monkeypatch, name, value):
    monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match=name):
        getattr(envs, name)
