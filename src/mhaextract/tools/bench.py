"""mhaextract beside its baselines, on the same targets in the same run (``mhaextract bench``).

For every ``(d, H)`` a random target (:meth:`MultiHeadAttention.random`, fixed seed) is
extracted by

* **mhaextract** (:func:`mhaextract.extract`, float64, the paper's ``4Hd^2 - 2H + 1`` queries),
  and **mhaextract+refine** (the same answers polished by least squares, no extra query);
* **single-head** (:func:`mhaextract.baselines.extract_single_head`, ``d^2 + d`` queries: its
  algorithm cannot use more; for H > 1 the target breaks its one-head assumption);
* **distillation** (:func:`mhaextract.baselines.distill`, the paper's query budget).

Each row reports the queries measured at the oracle boundary, the max relative parameter error
after canonical alignment (:func:`mhaextract.compare`; ``inf`` when the canonical head count is
wrong), the output fidelity (relative RMS error on 1,000 fresh random queries of lengths 1..16,
longer than any method asked), wall seconds (querying included), whether the method's own checks
passed, and each baseline's error and time as a ratio to mhaextract's on the same target. The
``baseline wins`` column names every measure in which a baseline beats mhaextract.

A second table runs the prior paper's multi-head setting (heads in pairwise orthogonal
coordinate subspaces with known bases), where the single-head algorithm applies per subspace.

The markdown file is rewritten after every row, so an interrupted run keeps what it measured.
"""

from __future__ import annotations

import math
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..baselines import distill, extract_single_head
from ..baselines.distillation import paper_budget
from ..oracle.queries import random_queries
from ..run.validation import default_token_scale
from ..models.compare import compare
from ..api import extract
from ..checks.base import UnreliableExtractionWarning
from ..models.attention import MultiHeadAttention
from ..oracle.simulated import SimulatedOracle

#: Fresh queries for the output fidelity (lengths 1..FIDELITY_MAX_LENGTH).
FIDELITY_QUERIES = 1000
FIDELITY_MAX_LENGTH = 16
#: A method "found the heads" when its max relative parameter error is at most this.
EXTRACTED = 1e-6


@dataclass
class BenchSettings:
    """What ``run_bench`` runs. ``quick()`` is the small grid of ``mhaextract bench --quick``."""

    ds: tuple = (4, 8, 16)
    heads: tuple = (1, 2, 3)
    seed: int = 0
    restarts: int = 12
    adam_steps: int = 1500
    lbfgs_steps: int = 300
    orthogonal: bool = True

    @classmethod
    def quick(cls, **overrides) -> "BenchSettings":
        values = dict(ds=(4, 8), heads=(1, 2), restarts=6, adam_steps=600, lbfgs_steps=200)
        values.update(overrides)
        return cls(**values)

    def __post_init__(self):
        self.ds, self.heads = tuple(int(d) for d in self.ds), tuple(int(h) for h in self.heads)
        if not self.ds or min(self.ds) < 1:
            raise ValueError(f"ds must be positive token dimensions, got {self.ds}")
        if not self.heads or min(self.heads) < 1:
            raise ValueError(f"heads must be positive head counts, got {self.heads}")
        if int(self.restarts) < 1:
            raise ValueError(f"restarts must be >= 1, got {self.restarts}")
        for name in ("adam_steps", "lbfgs_steps"):
            if int(getattr(self, name)) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")


@dataclass
class BenchRow:
    """One method on one target. ``error`` is ``inf`` when the canonical head count is wrong;
    ``error_ratio``, ``time_ratio`` are against mhaextract's row of the same target."""

    table: str
    d: int
    H: int
    method: str
    queries: int
    error: float
    heads_found: int
    fidelity: float
    seconds: float
    ok: bool
    note: str = ""
    error_ratio: float = 1.0
    time_ratio: float = 1.0
    wins: list = field(default_factory=list)


def output_fidelity(model: MultiHeadAttention, target: MultiHeadAttention, sequences) -> float:
    """Relative RMS error ``sqrt(mean (f_model - f)^2 / mean f^2)`` on ``sequences``."""
    truth = target(sequences)
    got = model(sequences)
    return float(np.sqrt(np.mean((got - truth) ** 2) / max(np.mean(truth**2), 1e-300)))


def _error(model, target) -> tuple[float, int]:
    comparison = compare(model, target)
    return float(comparison.max_rel), comparison.heads_a


def orthogonal_target(d: int, heads: int, seed) -> tuple[MultiHeadAttention, list]:
    """Heads in pairwise orthogonal subspaces: signed, permuted coordinate blocks ``B_h`` (sizes as
    equal as possible), ``W_h = B_h A_h B_h^T``, ``v_h = B_h b_h`` with ``A_h`` N(0, 1/d), ``b_h`` N(0, 1)."""
    if heads > d:
        raise ValueError(f"{heads} orthogonal subspaces do not fit in d = {d}")
    rng = np.random.default_rng(seed)
    signed = np.eye(d)[:, rng.permutation(d)] * rng.choice([-1.0, 1.0], size=d)
    sizes = [d // heads + (h < d % heads) for h in range(heads)]
    bases = np.split(signed, np.cumsum(sizes)[:-1], axis=1)
    W = np.array([B @ rng.standard_normal((B.shape[1],) * 2) @ B.T for B in bases]) / np.sqrt(d)
    v = np.array([B @ rng.standard_normal(B.shape[1]) for B in bases])
    return MultiHeadAttention(W, v), bases


def _timed(call):
    started = time.perf_counter()
    with warnings.catch_warnings():  # failed checks are reported in the table's "checks" column
        warnings.simplefilter("ignore", UnreliableExtractionWarning)
        result = call()
    return result, time.perf_counter() - started


def _row(table, d, H, method, result, seconds, target, fresh, note) -> BenchRow:
    error, found = _error(result.model, target)
    return BenchRow(table, d, H, method, result.queries, error, found, output_fidelity(result.model, target, fresh),
                    seconds, result.ok, note)


def _compare_to_ours(rows: list[BenchRow]) -> None:
    """Ratios against mhaextract and the measures in which each baseline wins."""
    ours = rows[0]
    for row in rows[1:]:
        if row.method.startswith("mhaextract"):
            continue  # our own variants are not baselines
        with np.errstate(divide="ignore", invalid="ignore"):
            row.error_ratio = float(np.divide(row.error, ours.error)) if ours.error else math.inf
        row.time_ratio = row.seconds / ours.seconds
        # Fewer queries or seconds count only for a baseline that found the heads: a cheap failure
        # is no win. Accuracy and passing checks that ours failed always count.
        extracted = row.error <= EXTRACTED
        row.wins = [name for name, better in [
            ("queries", extracted and row.queries < ours.queries),
            ("error", row.error < ours.error),
            ("fidelity", row.fidelity < ours.fidelity),
            ("time", extracted and row.seconds < ours.seconds),
            ("checks", row.ok and not ours.ok),
        ] if better]


def run_bench(settings: BenchSettings | None = None, out_dir="benchmarks/out", console=None, progress=None):
    """Run the benchmark; write ``bench.md`` (after every row) and ``bench.png`` to ``out_dir``.

    Returns the list of :class:`BenchRow`. ``console`` (a rich Console) gets each finished table
    line as it is measured.
    """
    settings = settings or BenchSettings()
    import scipy.optimize  # noqa: F401  (imported before the clocks start: no method pays for imports)
    import torch  # noqa: F401

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    rows: list[BenchRow] = []
    say = console.print if console is not None else (lambda *args, **kwargs: None)
    say(_header(settings))
    say(_table([]), markup=False, highlight=False)
    try:
        for d in settings.ds:
            for H in settings.heads:
                measured = _general(d, H, settings, progress)
                rows += measured
                _write(out, settings, rows)
                for row in measured:
                    say(_line(row), markup=False, highlight=False)
        if settings.orthogonal and any(2 <= H <= d for d in settings.ds for H in settings.heads):
            say(ORTHOGONAL_TITLE)
            say(_table([]), markup=False, highlight=False)
            for d in settings.ds:
                for H in settings.heads:
                    if 2 <= H <= d:
                        measured = _orthogonal(d, H, settings)
                        rows += measured
                        _write(out, settings, rows)
                        for row in measured:
                            say(_line(row), markup=False, highlight=False)
    finally:
        if rows:
            _plot(out / "bench.png", rows)
    return rows


def _general(d, H, settings, progress) -> list[BenchRow]:
    target_seed = 1000 * settings.seed + 10 * d + H
    target = MultiHeadAttention.random(d, H, seed=target_seed)
    oracle = SimulatedOracle(target)
    fresh = random_queries(np.random.default_rng(target_seed + 7), FIDELITY_QUERIES, d, default_token_scale(d),
                           (1, FIDELITY_MAX_LENGTH), spread=1.0)
    ours, seconds = _timed(lambda: extract(oracle, d, heads=H, seed=target_seed + 1, schedule="paper",
                                           progress=progress, on_failure="warn"))
    rows = [_row("general", d, H, "mhaextract", ours, seconds, target, fresh, "float64")]
    # Ours again, polished by least squares on the same answers (no extra query: the same budget).
    refined, seconds = _timed(lambda: extract(oracle, d, heads=H, seed=target_seed + 1, schedule="paper",
                                              progress=progress, refine=True, refine_queries=0, on_failure="warn"))
    rows.append(_row("general", d, H, "mhaextract+refine", refined, seconds, target, fresh,
                     "float64, refine=True, refine_queries=0"))
    single, seconds = _timed(lambda: extract_single_head(oracle, d, seed=target_seed + 2, progress=progress,
                                                         on_failure="warn"))
    rows.append(_row("general", d, H, "single-head", single, seconds, target, fresh,
                     "" if H == 1 else f"assumes 1 head, target has {H}"))
    student, seconds = _timed(lambda: distill(
        oracle, d, H, n_queries=paper_budget(d, H), restarts=settings.restarts, adam_steps=settings.adam_steps,
        lbfgs_steps=settings.lbfgs_steps, seed=target_seed + 3, progress=progress, on_failure="warn"))
    converged = int(round(student.converged * student.restarts))
    rows.append(_row("general", d, H, "distillation", student, seconds, target, fresh,
                     f"{converged}/{student.restarts} restarts converged"))
    _compare_to_ours(rows)
    return rows


def _orthogonal(d, H, settings) -> list[BenchRow]:
    target_seed = 1000 * settings.seed + 500 + 10 * d + H
    target, bases = orthogonal_target(d, H, target_seed)
    oracle = SimulatedOracle(target)
    fresh = random_queries(np.random.default_rng(target_seed + 7), FIDELITY_QUERIES, d, default_token_scale(d),
                           (1, FIDELITY_MAX_LENGTH), spread=1.0)
    ours, seconds = _timed(lambda: extract(oracle, d, heads=H, seed=target_seed + 1, schedule="paper", on_failure="warn"))
    rows = [_row("orthogonal", d, H, "mhaextract", ours, seconds, target, fresh, "float64; bases not used")]
    single, seconds = _timed(lambda: extract_single_head(oracle, d, subspaces=bases, seed=target_seed + 2,
                                                         on_failure="warn"))
    dims = "+".join(str(r) for r in single.dimensions)
    rows.append(_row("orthogonal", d, H, "single-head", single, seconds, target, fresh,
                     f"per subspace, known bases (r = {dims})"))
    _compare_to_ours(rows)
    return rows


# ---------------------------------------------------------------------------------------- output
ORTHOGONAL_TITLE = "Heads in orthogonal coordinate subspaces with known bases (the prior paper's assumption)"
_COLUMNS = ("d", "H", "method", "queries", "max param. error", "output fidelity", "seconds", "checks",
            "error / ours", "time / ours", "baseline wins", "note")


def _number(value: float) -> str:
    if not math.isfinite(value):
        return "inf"
    return f"{value:.1e}" if value else "0"


def _line(row: BenchRow) -> str:
    ours = row.method.startswith("mhaextract")
    found = f"{row.heads_found} head" + ("" if row.heads_found == 1 else "s")
    error = _number(row.error) + ("" if math.isfinite(row.error) else f" ({found} found)")
    wins = ", ".join(f"**{name}**" for name in row.wins) if row.wins else ("-" if not ours else "")
    cells = [str(row.d), str(row.H), row.method, str(row.queries), error, _number(row.fidelity), f"{row.seconds:.2f}",
             "ok" if row.ok else "FAILED", "1" if ours else _number(row.error_ratio),
             "1" if ours else f"{row.time_ratio:.2g}", wins, row.note]
    return "| " + " | ".join(cells) + " |"


def _header(settings: BenchSettings) -> str:
    return (f"Targets: MultiHeadAttention.random(d, H) (W ~ N(0, 1/d), v ~ N(0, 1)), seed {settings.seed}. "
            f"Distillation: {settings.restarts} restarts x {settings.adam_steps} Adam steps (float64, batched), "
            f"then L-BFGS (<= {settings.lbfgs_steps} iterations) on every restart; one torch thread. Fewer queries or seconds of a baseline count as wins only where it found "
            f"the heads (max parameter error <= {EXTRACTED:g}).")


def _table(rows: list[BenchRow]) -> str:
    head = "| " + " | ".join(_COLUMNS) + " |\n|" + "---|" * len(_COLUMNS)
    return "\n".join([head] + [_line(row) for row in rows])


def _write(out: Path, settings: BenchSettings, rows: list[BenchRow]) -> None:
    general = [row for row in rows if row.table == "general"]
    orthogonal = [row for row in rows if row.table == "orthogonal"]
    text = ["# mhaextract beside its baselines", "", _header(settings), "",
            f"Output fidelity: relative RMS error on {FIDELITY_QUERIES} fresh random queries of lengths "
            f"1..{FIDELITY_MAX_LENGTH}. Errors after canonical alignment (inf: wrong head count). "
            "Ratios > 1 favour mhaextract; **bold** marks a measure in which the baseline wins.", "",
            "## Random targets", "", _table(general)]
    if orthogonal:
        text += ["", "## " + ORTHOGONAL_TITLE, "",
                 _table(orthogonal)]
    (out / "bench.md").write_text("\n".join(text) + "\n")


def _plot(path: Path, rows: list[BenchRow]) -> None:
    """Three panels over the targets: max parameter error, output fidelity, seconds, one bar per method."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = []
    for row in rows:
        label = f"d={row.d}\nH={row.H}" + ("\northo" if row.table == "orthogonal" else "")
        if label not in labels:
            labels.append(label)
    methods = ["mhaextract", "mhaextract+refine", "single-head", "distillation"]
    colors = {"mhaextract": "tab:blue", "mhaextract+refine": "tab:purple", "single-head": "tab:orange",
              "distillation": "tab:green"}
    fig, axes = plt.subplots(3, 1, figsize=(max(8, 0.9 * len(labels) + 2), 10), sharex=True)
    ceiling = 10.0
    for ax, (attribute, title) in zip(axes, [("error", "max relative parameter error (inf drawn at 10)"),
                                             ("fidelity", "output fidelity (relative RMS error, fresh queries)"),
                                             ("seconds", "wall seconds")]):
        for k, method in enumerate(methods):
            xs, heights = [], []
            for row in rows:
                if row.method != method:
                    continue
                label = f"d={row.d}\nH={row.H}" + ("\northo" if row.table == "orthogonal" else "")
                value = getattr(row, attribute)
                xs.append(labels.index(label) + (k - 1.5) * 0.2)
                # inf errors (wrong head count) are drawn at the ceiling; seconds are never clipped
                heights.append(value if attribute == "seconds" else min(value, ceiling) if math.isfinite(value) else ceiling)
            ax.bar(xs, [max(h, 1e-17) for h in heights], width=0.2, color=colors[method], label=method)
        ax.set_yscale("log")
        ax.set_title(title, fontsize=10)
        ax.grid(axis="y", alpha=0.3)
    axes[0].legend(fontsize=8, ncol=4)
    axes[-1].set_xticks(range(len(labels)))
    axes[-1].set_xticklabels(labels, fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
