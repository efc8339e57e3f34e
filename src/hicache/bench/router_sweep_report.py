"""``hicache bench router --sweep``'s results: per point, each router pooled over its repeats,
hicache's routers held against SGLang's, and the state file that lets a sweep resume.

Per point and contender (a router and its flags): throughput (prompt, cached included, plus
output tokens over the runs' summed durations), mean and p99 TTFT over every successful
request, the share of prompt tokens each tier served. Each of hicache's contenders is held
against SGLang's best per metric (the highest throughput, the lowest mean and the lowest p99
TTFT among SGLang's settings that ran): the ratios are ours / theirs. Issue 34's targets:

- throughput >= 1.2x where the tiers matter (the working set is larger than one worker's
  L1 + L2); not evaluated elsewhere;
- throughput >= 1.0x everywhere;
- mean TTFT <= 0.8x; p99 TTFT <= 1.0x.

The throughput targets are evaluated on closed-loop points only: open-loop arrivals offer
both routers the same schedule, so their throughputs match (the offered load) while both
keep up, and a router that falls behind shows it in its TTFT, which every point evaluates.

A target whose ratio could not be measured (a side has no result) is None, never met.
``router_sweep.json`` holds the sweep's settings and every point's result. A contender is
done at a point when the point has its result with the same setting (kind, policy, flags,
program, and for ours the router's defaults of the scoring flags) and every run of the
point finished without a failed request; a later session runs only the contenders not done
there (all of them where a run failed), and keeps the others' results, so a setting added
later (another ``--sglang-args``) runs alone, and a change of the router's defaults reruns
ours. A state file written with other cluster settings is refused rather than mixed.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from hicache.bench.report import markdown_table
from hicache.bench.router_report import PolicyRun, policy_results
from hicache.bench.ttft_prediction import PredictionCheck, prediction_table
from hicache.bench.turn_placement import Placement

TARGET_THROUGHPUT_TIERS = 1.2
TARGET_THROUGHPUT_ANY = 1.0
TARGET_TTFT_MEAN = 0.8
TARGET_TTFT_P99 = 1.0
# SGLang's run at its defaults: the closed-loop capacity of a point is its request rate.
REFERENCE = "sglang"


@dataclass(frozen=True)
class Contender:
    """One router setting a point runs: ``kind`` hicache (``hicache router``) or sglang."""

    name: str
    kind: str
    policy: str
    args: str  # more router flags
    program: str | None  # None: ``hicache router``
    # hicache: the router's own defaults for what its flags leave out (a result taken under
    # other defaults is another setting: ``router_sweep.router_defaults``).
    defaults: str = ""

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class ContenderStats:
    """A contender's runs at one point, pooled."""

    name: str
    kind: str
    runs: int
    requests: int
    failed: int
    throughput: float  # total tokens / s
    ttft_mean_s: float | None
    ttft_p99_s: float | None
    request_rps: float  # successful requests / s
    tier_share: dict[str, float]
    setting: dict[str, Any] = field(default_factory=dict)  # the Contender's to_json()
    # Of its later turns, the share sent to the worker of the turn before
    # (``turn_placement.py``); None: not known (state files from before it was kept).
    kept_share: float | None = None
    # How well its router predicted TTFT, over its runs' streamed decisions
    # (``ttft_prediction.py``); None: another router, or state files from before.
    prediction: PredictionCheck | None = None

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> ContenderStats:
        prediction = data.get("prediction")
        return cls(**{**data, "prediction": None if prediction is None
                      else PredictionCheck(**prediction)})


@dataclass(frozen=True)
class Evaluation:
    """One of hicache's contenders against SGLang's best, at one point."""

    contender: str
    throughput_ratio: float | None
    ttft_mean_ratio: float | None
    ttft_p99_ratio: float | None
    # >= 1.2x; None: the tiers do not matter here, an open-loop point, or unmeasured.
    throughput_tiers: bool | None
    throughput_any: bool | None  # >= 1.0x; None: an open-loop point, or unmeasured
    ttft_mean: bool | None
    ttft_p99: bool | None
    tiers_matter: bool
    closed_loop: bool

    def all_met(self) -> bool:
        """Every target evaluated at this point is met (an unmeasured one is not)."""
        checks = [self.ttft_mean, self.ttft_p99]
        if self.closed_loop:
            checks.append(self.throughput_any)
            if self.tiers_matter:
                checks.append(self.throughput_tiers)
        return all(c is True for c in checks)


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b is not None and b > 0 else None


def _at_least(value: float | None, bound: float) -> bool | None:
    return None if value is None else value >= bound


def _at_most(value: float | None, bound: float) -> bool | None:
    return None if value is None else value <= bound


def evaluate(
    ours: ContenderStats, theirs: Sequence[ContenderStats], tiers_matter: bool,
    closed_loop: bool = True,
) -> Evaluation:
    """``ours`` against the best of ``theirs`` per metric; see the module docstring."""
    best_throughput = max((t.throughput for t in theirs if t.requests), default=None)
    best_mean = min((t.ttft_mean_s for t in theirs if t.ttft_mean_s is not None), default=None)
    best_p99 = min((t.ttft_p99_s for t in theirs if t.ttft_p99_s is not None), default=None)
    throughput = _ratio(ours.throughput, best_throughput) if ours.requests else None
    mean = _ratio(ours.ttft_mean_s, best_mean)
    p99 = _ratio(ours.ttft_p99_s, best_p99)
    return Evaluation(
        contender=ours.name, throughput_ratio=throughput, ttft_mean_ratio=mean,
        ttft_p99_ratio=p99,
        throughput_tiers=(
            _at_least(throughput, TARGET_THROUGHPUT_TIERS)
            if tiers_matter and closed_loop else None),
        throughput_any=_at_least(throughput, TARGET_THROUGHPUT_ANY) if closed_loop else None,
        ttft_mean=_at_most(mean, TARGET_TTFT_MEAN), ttft_p99=_at_most(p99, TARGET_TTFT_P99),
        tiers_matter=tiers_matter, closed_loop=closed_loop,
    )


def contender_stats(contender: Contender, runs: Sequence[PolicyRun]) -> ContenderStats:
    name, kind, setting = contender.name, contender.kind, contender.to_json()
    pooled = [r for r in policy_results(runs) if r.policy == name]
    summaries = [r.summary for r in runs if r.summary is not None]
    duration = math.fsum(s.duration_s for s in summaries)
    ok = math.fsum(s.request_throughput * s.duration_s for s in summaries)
    if not pooled:
        return ContenderStats(name, kind, len(runs), 0, 0, 0.0, None, None, 0.0, {}, setting)
    p = pooled[0]
    placed = sum((r.placement for r in runs if r.placement is not None), Placement())
    predictions = [p for r in runs for p in r.predictions]
    return ContenderStats(
        name=name, kind=kind, runs=len(runs), requests=p.requests, failed=p.failed,
        throughput=p.total_throughput,
        ttft_mean_s=None if p.ttft_s is None else p.ttft_s.mean,
        ttft_p99_s=None if p.ttft_s is None else p.ttft_s.p99,
        request_rps=ok / duration if duration > 0 else 0.0, tier_share=p.tier_share,
        setting=setting, kept_share=placed.share,
        prediction=PredictionCheck.of(predictions) if predictions else None,
    )


@dataclass
class PointResult:
    id: str
    point: dict[str, Any]  # prompt, ws, l3, arrival
    sizes: dict[str, Any]  # router_sweep.PointSizes.to_json()
    rate_rps: float | None  # the open-loop arrival rate; None: closed loop
    capacity_rps: float | None  # closed: the reference's request rate; open: the one used
    contenders: list[ContenderStats] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)

    def missing(self, contenders: Sequence[Contender]) -> list[Contender]:
        """Of ``contenders``, those this result does not hold done (module docstring)."""
        if self.errors:
            return list(contenders)
        held = {(c.name, json.dumps(c.setting, sort_keys=True)) for c in self.contenders}
        return [c for c in contenders
                if (c.name, json.dumps(c.to_json(), sort_keys=True)) not in held]

    @property
    def done(self) -> bool:
        """Every run of this point finished without a failed request."""
        return not self.errors and bool(self.contenders)

    @property
    def tiers_matter(self) -> bool:
        """Is the working set larger than one worker's L1 + L2?"""
        return bool(
            self.sizes["working_set_tokens"] > self.sizes["l1_tokens"] + self.sizes["l2_tokens"])

    def evaluations(self) -> list[Evaluation]:
        theirs = [c for c in self.contenders if c.kind == "sglang"]
        closed = self.point.get("arrival") == "closed"
        return [evaluate(c, theirs, self.tiers_matter, closed)
                for c in self.contenders if c.kind == "hicache"]

    @classmethod
    def failed(
        cls, point_id: str, point: dict[str, Any], sizes: dict[str, Any], error: str,
    ) -> PointResult:
        return cls(point_id, point, sizes, None, None, [], [error])

    @classmethod
    def of(
        cls, point_id: str, point: dict[str, Any], sizes: dict[str, Any], rate: float | None,
        capacity: float | None, runs: Sequence[tuple[Contender, PolicyRun]],
        contenders: Sequence[Contender], previous: PointResult | None = None,
    ) -> PointResult:
        """The runs of ``contenders`` (this session's), and ``previous``'s results of any
        other contender (an earlier session's, kept when it had no failed run)."""
        stats = [
            contender_stats(c, [r for k, r in runs if k.name == c.name]) for c in contenders
        ]
        if previous is not None and not previous.errors:
            ran = {c.name for c in contenders}
            stats = [c for c in previous.contenders if c.name not in ran] + stats
        if rate is None:  # a closed-loop point measures the capacity its open ones use
            reference = next((s for s in stats if s.name == REFERENCE), None)
            capacity = reference.request_rps if reference and reference.request_rps else None
        errors = []
        for _, run in runs:
            if run.error is not None:
                errors.append(f"{run.stem}: {run.error.splitlines()[0]}")
            elif run.summary is not None and run.summary.overall.failed:
                errors.append(f"{run.stem}: {run.summary.overall.failed} requests failed")
        return cls(point_id, point, sizes, rate, capacity, stats, errors)

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["evaluations"] = [asdict(e) for e in self.evaluations()]
        return data

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> PointResult:
        return cls(
            data["id"], data["point"], data["sizes"], data["rate_rps"], data["capacity_rps"],
            [ContenderStats.from_json(c) for c in data["contenders"]], list(data["errors"]),
        )


class SweepState:
    """``router_sweep.json``: the settings and each point's latest result."""

    def __init__(self, path: Path, settings: dict[str, Any]) -> None:
        self.path = path
        self.settings = settings
        self.points: dict[str, PointResult] = {}

    @classmethod
    def load(cls, path: Path, settings: dict[str, Any]) -> SweepState:
        """The state at ``path`` (empty when there is none); a ValueError when it was
        written with other settings."""
        state = cls(path, settings)
        if not path.exists():
            return state
        data = json.loads(path.read_text(encoding="utf-8"))
        if data.get("settings") != settings:
            old = data.get("settings") or {}
            differ = sorted(k for k in {*old, *settings} if old.get(k) != settings.get(k))
            raise ValueError(
                f"{path} holds a sweep run with other settings ({', '.join(differ)}): give "
                "another --out-dir, or the same flags")
        state.points = {k: PointResult.from_json(v) for k, v in data["points"].items()}
        return state

    def done(self, point_id: str) -> bool:
        result = self.points.get(point_id)
        return result is not None and result.done

    def missing(self, point_id: str, contenders: Sequence[Contender]) -> list[Contender]:
        """The contenders still to run at the point (all where it has no clean result)."""
        result = self.points.get(point_id)
        return list(contenders) if result is None else result.missing(contenders)

    def result(self, point_id: str) -> PointResult | None:
        return self.points.get(point_id)

    def record(self, result: PointResult) -> None:
        self.points[result.id] = result

    def save(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps({
            "settings": self.settings,
            "points": {k: v.to_json() for k, v in self.points.items()},
        }, indent=2) + "\n", encoding="utf-8")
        tmp.replace(self.path)  # a sweep killed mid-write keeps the previous state


# ------------------------------------------------------------------------ tables
def _x(value: float | None) -> str | None:
    return None if value is None else f"{value:.2f}x"


def _s(value: float | None) -> str | None:
    return None if value is None else f"{value:.2f}"


def _mark(met: bool | None) -> str:
    return "n/a" if met is None else ("met" if met else "NOT met")


def _tiers(stats: ContenderStats | None) -> str | None:
    if stats is None or not stats.tier_share:
        return None
    share = stats.tier_share
    return " / ".join(f"{100 * share.get(k, 0.0):.0f}"
                      for k in ("device", "host", "storage", "recomputed"))


def _kept(ours: ContenderStats, theirs: ContenderStats | None) -> str | None:
    shares = [ours.kept_share, None if theirs is None else theirs.kept_share]
    if all(share is None for share in shares):
        return None
    return " / ".join("-" if v is None else f"{100 * v:.0f}" for v in shares)


def _best(values: Sequence[float | None], lowest: bool) -> float | None:
    present = [v for v in values if v is not None]
    if not present:
        return None
    return min(present) if lowest else max(present)


def points_table(results: Sequence[PointResult]) -> str:
    headers = [
        "point", "req/s (capacity)", "ours", "tok/s ours", "tok/s sglang", "ratio",
        "mean TTFT s ours", "sglang", "ratio", "p99 TTFT s ours", "sglang", "ratio",
        ">=1.2x (tiers)", ">=1.0x", "mean <=0.8x", "p99 <=1.0x",
        "tiers ours D/H/L3/R %", "tiers sglang D/H/L3/R %", "kept % ours / sglang",
    ]
    rows: list[list[Any]] = []
    for result in results:
        theirs = [c for c in result.contenders if c.kind == "sglang"]
        best_sglang = max(theirs, key=lambda c: c.throughput, default=None)
        rate = (
            f"{result.rate_rps:.2f} ({result.capacity_rps:.2f})"
            if result.rate_rps is not None and result.capacity_rps
            else (f"closed ({result.capacity_rps:.2f})" if result.capacity_rps else "closed")
        )
        evaluations = {e.contender: e for e in result.evaluations()}
        for ours in (c for c in result.contenders if c.kind == "hicache"):
            e = evaluations[ours.name]
            rows.append([
                result.id, rate, ours.name, ours.throughput,
                _best([t.throughput for t in theirs if t.requests], lowest=False),
                _x(e.throughput_ratio), _s(ours.ttft_mean_s),
                _s(_best([t.ttft_mean_s for t in theirs], lowest=True)), _x(e.ttft_mean_ratio),
                _s(ours.ttft_p99_s), _s(_best([t.ttft_p99_s for t in theirs], lowest=True)),
                _x(e.ttft_p99_ratio), _mark(e.throughput_tiers), _mark(e.throughput_any),
                _mark(e.ttft_mean), _mark(e.ttft_p99), _tiers(ours), _tiers(best_sglang),
                _kept(ours, best_sglang),
            ])
        if not result.contenders:
            rows.append([result.id, rate, None, *[None] * (len(headers) - 3)])
    return markdown_table(headers, rows)


def predictions_table(results: Sequence[PointResult]) -> str:
    """Per point and contender whose router logs its decisions (ours): how well it
    predicted the TTFT of the requests it sent."""
    rows = [
        (f"{result.id} {c.name}", c.prediction)
        for result in results for c in result.contenders if c.prediction is not None
    ]
    return prediction_table(rows) if rows else "(no decisions logged)"


def summary_table(results: Sequence[PointResult]) -> str:
    """Per hicache contender: of the points evaluated, how many meet each target."""
    counts: dict[str, list[list[bool | None]]] = {}
    for result in results:
        for e in result.evaluations():
            counts.setdefault(e.contender, []).append(
                [e.throughput_tiers, e.throughput_any, e.ttft_mean, e.ttft_p99,
                 e.all_met() if e.ttft_mean_ratio is not None else None])
    rows = []
    for name, marks in counts.items():
        cells: list[Any] = [name]
        for column in zip(*marks, strict=True):
            evaluated = [m for m in column if m is not None]
            cells.append(f"{sum(evaluated)} / {len(evaluated)}")
        rows.append(cells)
    return markdown_table(
        ["ours", ">=1.2x (tiers)", ">=1.0x", "mean <=0.8x", "p99 <=1.0x", "all"], rows)


def write_sweep_report(
    state: SweepState, order: Sequence[str], out_dir: Path, header: Sequence[str],
) -> Path:
    """``router_sweep.md`` and ``router_sweep.png`` for the points of ``order`` that have
    results (in that order, then any others the state holds)."""
    ids = [i for i in order if i in state.points]
    ids += [i for i in state.points if i not in ids]
    results = [state.points[i] for i in ids]
    lines = [
        "# hicache bench router --sweep", "", *header, "",
        "Ratios: ours / SGLang's best setting per metric (throughput > 1 and TTFT < 1 are "
        "better). Targets (issue 34): throughput >= 1.2x where the working set exceeds one "
        "worker's L1 + L2, >= 1.0x everywhere (both on closed-loop points: open-loop ones "
        "offer both routers the same load; n/a where not evaluated), mean TTFT <= 0.8x, p99 "
        "TTFT <= 1.0x. Tiers: share of prompt tokens served from device, host, L3, recomputed. "
        "req/s: the open-loop arrival rate (and the capacity it is a share of: SGLang's "
        "closed-loop request rate at the same workload).", "",
        "## Targets met", "", summary_table(results), "",
        "## Points", "", points_table(results) if results else "(no results)", "",
        "## The router's TTFT predictions", "",
        "Streamed requests of each run: the predicted TTFT of the chosen worker against the "
        "one the router measured (error: measured - predicted), pooled over a point's "
        "runs.", "",
        predictions_table(results), "",
        "## Sizes", "",
        markdown_table(
            ["point", "conversations", "rounds", "first prompt", "working set tokens",
             "L1 / L2 per worker", "small L3 cap MB", "run s", "status"],
            [[r.id, r.sizes["num_clients"], r.sizes["num_rounds"], r.sizes["request_length"],
              r.sizes["working_set_tokens"], f"{r.sizes['l1_tokens']} / {r.sizes['l2_tokens']}",
              None if r.sizes["l3_max_bytes"] is None else r.sizes["l3_max_bytes"] / 1e6,
              r.sizes.get("point_seconds"),
              "ok" if r.done else "; ".join(r.errors) or "no result"] for r in results],
        ), "",
    ]
    md = out_dir / "router_sweep.md"
    md.write_text("\n".join(lines), encoding="utf-8")
    if results:
        plot_ratios(results, out_dir / "router_sweep.png")
    return md


def plot_ratios(results: Sequence[PointResult], path: Path) -> Path:
    """Per point, each hicache contender's three ratios as bars, with the target lines."""
    import matplotlib

    matplotlib.use("Agg")  # files only; never needs a display
    import matplotlib.pyplot as plt

    names = list(dict.fromkeys(
        e.contender for r in results for e in r.evaluations()))
    fig, axes = plt.subplots(
        max(1, len(names)), 1, figsize=(max(8, 0.6 * len(results) + 3), 4 * max(1, len(names))),
        squeeze=False)
    series = (("throughput", "throughput_ratio", "tab:blue"),
              ("mean TTFT", "ttft_mean_ratio", "tab:orange"),
              ("p99 TTFT", "ttft_p99_ratio", "tab:red"))
    positions = list(range(len(results)))
    for ax, name in zip(axes[:, 0], names or ["(none)"], strict=False):
        for offset, (label, attr, color) in enumerate(series):
            values = []
            for result in results:
                e = next((e for e in result.evaluations() if e.contender == name), None)
                value = None if e is None else getattr(e, attr)
                values.append(float("nan") if value is None else value)
            ax.bar([p + (offset - 1) * 0.27 for p in positions], values, width=0.27,
                   label=label, color=color)
        for level, style, label in (
            (TARGET_THROUGHPUT_TIERS, ":", "throughput target (tiers matter)"),
            (TARGET_THROUGHPUT_ANY, "-", "throughput floor, p99 TTFT target"),
            (TARGET_TTFT_MEAN, "--", "mean TTFT target"),
        ):
            ax.axhline(level, color="grey", linestyle=style, linewidth=0.8, label=label)
        ax.set_xticks(positions, [r.id for r in results], rotation=30, ha="right",
                      fontsize="small")
        ax.set(title=f"{name} / sglang (best setting per metric)", ylabel="ratio")
        ax.grid(alpha=0.3, axis="y")
        # Beside the axes: over them it would hide bars.
        ax.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, format="png", dpi=100)
    plt.close(fig)
    return path
