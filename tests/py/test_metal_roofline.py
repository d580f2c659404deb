"""benchmarks/metal_roofline.py: the roofline arithmetic and the docs block it rewrites."""

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _script():
    spec = importlib.util.spec_from_file_location("metal_roofline", ROOT / "benchmarks" / "metal_roofline.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_time_is_the_larger_of_memory_and_compute():
    r = _script()
    rows = r.predict([{"unique": 68_000, "flops": 0, "calls": 2},         # 1 us per call on M1
                      {"unique": 0, "flops": 2_600_000, "calls": 1}])   # 1 us of M1 fp16
    assert abs(rows[0]["us"]["M1"] - 2.0) < 1e-9 and abs(rows[1]["us"]["M1"] - 1.0) < 1e-9
    assert abs(rows[0]["us"]["M4 Max"] - 2 * 68 / 546) < 1e-9


def test_rerun_replaces_the_table(tmp_path, monkeypatch):
    r = _script()
    doc = tmp_path / "kernels.md"
    doc.write_text("# Kernels\n\ntext\n")
    monkeypatch.setattr(r, "DOC", doc)
    r.write_doc("table one")
    r.write_doc("table two")
    text = doc.read_text()
    assert text.count(r.BEGIN) == 1 and "table two" in text and "table one" not in text
    assert text.startswith("# Kernels\n\ntext\n")


def test_docs_carry_the_table():
    r = _script()
    text = (ROOT / "docs" / "kernels.md").read_text()
    assert text.count(r.BEGIN) == 1 and text.count(r.END) == 1
    assert "tok/s bound" in text.split(r.BEGIN)[1]


def test_docs_carry_the_step_model_and_the_llama_cpp_comparison():
    _script()  # puts benchmarks/ on sys.path
    from doc_sections import markers

    text = (ROOT / "docs" / "kernels.md").read_text()
    for name, must in (("metal_step_model", "dispatches (ours + MLX)"), ("llama_cpp_vs_ours", "llama.cpp tok/s")):
        begin, end = markers(name)
        assert text.count(begin) == 1 and text.count(end) == 1
        assert must in text.split(begin)[1].split(end)[0]
