"""Shape and lane use of the Metal GGUF mat-vec kernel, counted in the emulator.

For decode shapes of SmolLM2-135M (Q4_1) and Gemma-3-270M (Q4_K_M, each tensor in the
type its file stores) and for every GGUF type at SmolLM2's sizes, runs the mat-vec kernel
once in the emulator's counting build and reports, for the kernel of this checkout ("new")
and the one of a git revision ("old", default 56e8e2f: one weight row per simdgroup, lanes
striding over its 16-weight chunks):

- unique / weights, unique / min: distinct device bytes over the launch / the weight
  bytes, / (weights + x + y), i.e. DRAM traffic with perfect caches against the floor;
- x reads: bytes of x loaded by all lanes / bytes of x, i.e. how often x comes back
  from cache;
- lane use: device loads summed over lanes / (32 x the busiest lane's, per simdgroup);
  1.0 means no lane idles while a sibling loads (mslemu.accounting.LaunchCounts.lane_use).

Nothing here is timed: the counts are exact and machine-independent. Large LM heads are
sampled (their first rows; every row is the same work, so the ratios do not change).

    .venv/bin/python benchmarks/metal_matvec_shape.py              # prints, rewrites the docs table
    .venv/bin/python benchmarks/metal_matvec_shape.py --old HEAD~1 --no-write
"""

from __future__ import annotations

import argparse
import struct
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

from vllm_metal import _core, emulation
from vllm_metal import kernel_traffic as kt

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "kernels.md"
sys.path.insert(0, str(Path(__file__).resolve().parent))
from doc_sections import write_section  # noqa: E402

OLD_REV = "56e8e2f"  # the last revision with one weight row per simdgroup
DTYPE = "float16"  # both models serve in float16 or bfloat16: 2-byte x and y

# (model, tensor(s), type in the file, n, k, rows in the file when sampled)
MODEL_CASES = [
    ("SmolLM2-135M Q4_1", "attn_q, attn_output", "Q4_1", 576, 576, None),
    ("SmolLM2-135M Q4_1", "attn_k, attn_v", "Q4_1", 192, 576, None),
    ("SmolLM2-135M Q4_1", "ffn_gate, ffn_up", "Q4_1", 1536, 576, None),
    ("SmolLM2-135M Q4_1", "ffn_down", "Q4_1", 576, 1536, None),
    ("SmolLM2-135M Q4_1", "output (tied token_embd)", "Q8_0", 1536, 576, 49152),
    ("Gemma-3-270M Q4_K_M", "attn_q", "Q5_0", 1024, 640, None),
    ("Gemma-3-270M Q4_K_M", "attn_k, attn_v", "Q5_0", 256, 640, None),
    ("Gemma-3-270M Q4_K_M", "attn_v (9 of 18 layers)", "Q8_0", 256, 640, None),
    ("Gemma-3-270M Q4_K_M", "attn_output", "Q4_K", 640, 1024, None),
    ("Gemma-3-270M Q4_K_M", "ffn_gate, ffn_up", "Q5_0", 2048, 640, None),
    ("Gemma-3-270M Q4_K_M", "ffn_down", "Q4_K", 640, 2048, None),
    ("Gemma-3-270M Q4_K_M", "ffn_down (9 of 18 layers)", "Q6_K", 640, 2048, None),
    ("Gemma-3-270M Q4_K_M", "output (tied token_embd)", "Q8_0", 1024, 640, 262144),
]
TYPES = ["F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K",
         "Q5_K", "Q6_K", "IQ4_NL", "IQ4_XS", "IQ3_XXS", "IQ3_S"]
TYPE_SHAPES = [(576, 576), (1536, 576), (576, 1536)]  # SmolLM2's q/o, gate/up, down (n, k)


def _block(qtype: str) -> int:
    return _core.gguf_type_info(qtype)[1]


class OldKernel:
    """gguf_matvec of a git revision, built from that revision's src/metal headers, with the
    launch that revision planned (4 rows per threadgroup, 8 x rows per grid row)."""

    def __init__(self, rev: str):
        self.rev = rev
        self.dir = Path(tempfile.mkdtemp(prefix="old_matvec_"))
        names = subprocess.run(["git", "ls-tree", "--name-only", rev, "src/metal/"], cwd=ROOT,
                               check=True, capture_output=True, text=True).stdout.split()
        for name in names:
            if name.endswith(".h") or name.endswith("gguf_matmul.metal"):
                text = subprocess.run(["git", "show", f"{rev}:{name}"], cwd=ROOT, check=True,
                                      capture_output=True).stdout
                (self.dir / Path(name).name).write_bytes(text)
        self.lib = emulation.mslemu_module().Library(str(self.dir / "gguf_matmul.metal"), accounting=True)

    def run(self, arrays: list, qtype: str, m: int, n: int, k: int):
        x, blocks, y = arrays
        row_bytes = blocks.size // n
        args = struct.pack("<qqQIIII", k, n, row_bytes, m, n, k, -(-k // 16))
        return self.lib.dispatch_threadgroups(
            f"gguf_matvec_{qtype.lower()}_{DTYPE}", (-(-n // 4), -(-m // 8), 1), (128, 1, 1),
            {0: blocks.reshape(-1), 1: x.reshape(-1).view(np.uint8), 2: y.reshape(-1).view(np.uint8),
             3: args})


def _stats(counts, case: kt.Case, x_index: int, args_index: int) -> dict:
    counts.excluded = (args_index,)
    dev = counts.device
    x_bytes = case.arrays[0].nbytes
    unique = dev.read_unique + dev.written_unique
    return {
        "unique_w": unique / case.arrays[1].nbytes,
        "unique": unique / case.minimum,
        "x_reads": counts.buffers[x_index].read / x_bytes,
        "lane_use": counts.lane_use,
    }


def measure(qtype: str, n: int, k: int, m: int, old: OldKernel | None) -> dict:
    case = kt.gguf_matvec(qtype, DTYPE, m, n, k)
    assert case.plan[0].kernel.startswith("gguf_matvec"), case.plan[0].kernel
    t = kt.measure(case)
    lanes, per_lane, piece = _core.gguf_matvec_shape(k)
    row = {"type": qtype, "n": n, "k": k, "m": m, "shape": f"{lanes} x {per_lane} x {piece}",
           "new": _stats(t.launches[0], case, x_index=1, args_index=3)}
    if old is not None:  # its own output array: the values are the tests' business
        arrays = [case.arrays[0], case.arrays[1], np.zeros_like(case.arrays[2])]
        row["old"] = _stats(old.run(arrays, qtype, m, n, k), case, x_index=1, args_index=3)
    return row


def _cell(r: dict, key: str, fmt: str) -> str:
    new = format(r["new"][key], fmt)
    return f"{format(r['old'][key], fmt)} → {new}" if "old" in r else new


def table(rows: list[dict], first: list[str], old_rev: str | None) -> str:
    vs = f" ({old_rev} → this kernel)" if old_rev else ""
    head = first + ["shape", f"unique / weights{vs}", f"unique / min{vs}", f"x reads{vs}",
                    f"lane use{vs}"]
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = r["first"] + [r["shape"], _cell(r, "unique_w", ".3f"), _cell(r, "unique", ".3f"),
                              _cell(r, "x_reads", ".1f"),
                              _cell(r, "lane_use", ".3f")]
        out.append("| " + " | ".join(cells) + " |")
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--old", default=OLD_REV, help="git revision of the old kernel ('' to skip)")
    ap.add_argument("--m", type=int, nargs="+", default=[1, 4],
                    help="x rows (decode batch) of the model tables; the type table takes the first")
    ap.add_argument("--no-write", action="store_true", help="print only, leave docs/kernels.md")
    a = ap.parse_args()
    old = OldKernel(a.old) if a.old else None
    rev = a.old or None
    parts = [f"Counted in the emulator (counting build), {DTYPE} x; shape = lanes per weight row x "
             "rows per lane x weights per piece. Produced by", "",
             "    .venv/bin/python benchmarks/metal_matvec_shape.py"
             + ("" if a.m == [1, 4] else " --m " + " ".join(map(str, a.m))), ""]
    for m in a.m:
        model_rows = []
        for model, tensor, qtype, n, k, full in MODEL_CASES:
            r = measure(qtype, n, k, m, old)
            rows = f"{n} of {full}" if full else str(n)
            r["first"] = [model, tensor, qtype, f"{rows} x {k}"]
            model_rows.append(r)
            print(m, model, tensor, r, flush=True)
        parts += [f"m = {m}:", "", table(model_rows, ["model", "tensor", "type", "n x k"], rev), ""]
    type_rows = []
    for qtype in TYPES:
        for n, k in TYPE_SHAPES:
            if k % _block(qtype):
                continue  # 256-weight super-blocks do not tile k = 576
            r = measure(qtype, n, k, a.m[0], old)
            r["first"] = [qtype, f"{n} x {k}"]
            type_rows.append(r)
            print(qtype, n, k, r, flush=True)
    parts += [f"Every type at SmolLM2's sizes, m = {a.m[0]} (the 256-weight super-block types skip "
              "k = 576):", "", table(type_rows, ["type", "n x k"], rev)]
    body = "\n".join(parts)
    print(body)
    if not a.no_write:
        write_section(DOC, "metal_matvec_shape", body, heading="Metal mat-vec: shape and lane use")


if __name__ == "__main__":
    main()
