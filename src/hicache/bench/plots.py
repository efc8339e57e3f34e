"""Plots of client-benchmark runs (PNG): ``hicache bench plot run1.json run2.json -o out.png``.

One figure puts several runs side by side: mean and p90 TTFT per round, cache
hit rate per round (with the device/host/storage split of the whole run as
bars), and input throughput. Inputs are the summaries ``--json-out`` writes.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from hicache.bench.client import TIERS
from hicache.bench.report import RunSummary


def plot_runs(summaries: Sequence[RunSummary], path: str | Path, title: str | None = None) -> Path:
    """Draw ``summaries`` into one PNG at ``path`` (parent folders are created)."""
    if not summaries:
        raise ValueError("nothing to plot: no runs")
    import matplotlib

    matplotlib.use("Agg")  # files only; never needs a display
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(12, 8))
    ax_ttft, ax_hit, ax_p90, ax_bars = axes[0, 0], axes[0, 1], axes[1, 0], axes[1, 1]
    for summary in summaries:
        rounds = list(range(len(summary.rounds)))
        mean = [_ms(g.ttft_s.mean if g.ttft_s else None) for g in summary.rounds]
        p90 = [_ms(g.ttft_s.p90 if g.ttft_s else None) for g in summary.rounds]
        hit = [_pct(g.hit_rate) for g in summary.rounds]
        ax_ttft.plot(rounds, mean, marker="o", label=summary.label)
        ax_p90.plot(rounds, p90, marker="o", label=summary.label)
        ax_hit.plot(rounds, hit, marker="o", label=summary.label)
    ax_ttft.set(title="mean TTFT per round", xlabel="round", ylabel="ms")
    ax_p90.set(title="p90 TTFT per round", xlabel="round", ylabel="ms")
    ax_hit.set(title="cache hit rate per round", xlabel="round", ylabel="% of prompt tokens")
    ax_hit.set_ylim(0, 100)
    for ax in (ax_ttft, ax_p90, ax_hit):
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small")
        # Rounds are whole numbers.
        ax.xaxis.get_major_locator().set_params(integer=True)

    labels = [s.label for s in summaries]
    positions = list(range(len(summaries)))
    ax_bars.bar(positions, [s.input_throughput for s in summaries], color="tab:blue")
    ax_bars.set(title="input throughput", ylabel="prompt tokens / s")
    ax_bars.set_xticks(positions, labels, rotation=20, ha="right")
    ax_bars.grid(alpha=0.3, axis="y")
    # The hit rate by tier, as text over each bar, where the server reports tiers.
    for x, summary in zip(positions, summaries, strict=True):
        tiers = summary.overall.tier_hit_rate
        if tiers is not None:
            text = "\n".join(f"{t[0].upper()} {100 * tiers[t]:.0f}%" for t in TIERS)
            ax_bars.annotate(
                text, (x, summary.input_throughput), ha="center", va="bottom", fontsize=7
            )
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, format="png", dpi=100)
    plt.close(fig)
    return out


def _ms(seconds: float | None) -> float:
    return float("nan") if seconds is None else seconds * 1000


def _pct(fraction: float | None) -> float:
    return float("nan") if fraction is None else fraction * 100


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("runs", nargs="+", help="summary JSON files (--json-out of a run)")
    parser.add_argument("-o", "--output", required=True, help="PNG file to write")
    parser.add_argument("--title", default=None)


def main(args: argparse.Namespace) -> int:
    try:
        summaries = [RunSummary.load(path) for path in args.runs]
    except (OSError, ValueError, KeyError, TypeError) as error:
        print(f"error: cannot read a run summary: {error}", file=sys.stderr)
        return 2
    print(plot_runs(summaries, args.output, args.title))
    return 0
