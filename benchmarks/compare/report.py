"""The comparison's markdown table and plots, written into docs/."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from doc_sections import write_section  # noqa: E402


def _f(v, fmt):
    return "—" if v is None else format(v, fmt)


def table(run: dict) -> str:
    lines = [f"Model {run['model']}; {run['machine']} ({run['cpu']}); {run['date']}.",
             f"Command: `{run['command']}`", "",
             "| mix | conc. | server | done | TTFT mean / p99 (s) | TPOT (ms) | output tok/s | total tok/s |",
             "|---|---:|---|---:|---:|---:|---:|---:|"]
    for c in sorted(run["cells"], key=lambda c: (c["mix"], c["concurrency"], c["server"])):
        failed = f" ({c['failed']} failed)" if c["failed"] else ""
        lines.append(
            f"| {c['mix']} | {c['concurrency']} | {c['server']} | {c['completed']}{failed} | "
            f"{_f(c['ttft_mean_s'], '.2f')} / {_f(c['ttft_p99_s'], '.2f')} | "
            f"{_f(c['tpot_mean_ms'], '.1f')} | {c['output_tok_s']:.1f} | {c['total_tok_s']:.1f} |")
    lines += ["", "| server | peak RSS (MB) | startup (s) |", "|---|---:|---:|"]
    for name, s in run["servers"].items():
        lines.append(f"| {name} | {s['peak_rss_mb']:.0f} | {s['startup_s']:.0f} |")
    return "\n".join(lines)


def plots(run: dict, img_dir: Path) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    img_dir.mkdir(parents=True, exist_ok=True)
    names = []
    for metric, label, fname in (("output_tok_s", "output tokens/s", "compare_throughput.png"),
                                 ("ttft_mean_s", "mean TTFT (s)", "compare_ttft.png")):
        mixes = sorted({c["mix"] for c in run["cells"]})
        fig, axes = plt.subplots(1, len(mixes), figsize=(4.5 * len(mixes), 3.6), squeeze=False)
        for ax, mix in zip(axes[0], mixes):
            for server in dict.fromkeys(c["server"] for c in run["cells"]):
                pts = sorted((c["concurrency"], c[metric]) for c in run["cells"]
                             if c["mix"] == mix and c["server"] == server and c[metric] is not None)
                if pts:
                    ax.plot(*zip(*pts), marker="o", label=server)
            ax.set_xscale("log", base=2)
            ax.set_title(mix)
            ax.set_xlabel("concurrency")
            ax.set_ylabel(label)
            ax.grid(alpha=0.3)
        axes[0][0].legend()
        fig.suptitle(f"{run['model']}, {run['machine']}")
        fig.tight_layout()
        fig.savefig(img_dir / fname, dpi=90)
        plt.close(fig)
        names.append(fname)
    return names


def write_docs(run: dict, docs: Path) -> None:
    body = table(run) + "\n\n" + "\n".join(f"![{n}](img/{n})" for n in plots(run, docs / "img"))
    write_section(docs / "benchmarks.md", "compare", body, "Serving against the peers (benchmarks/compare)")
