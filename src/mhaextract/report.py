"""Tables for people: a run's summary as a rich table."""

from __future__ import annotations

from rich.table import Table

from .compare import Comparison
from .learner import Extraction


def _fmt(value) -> str:
    value = float(value)
    return f"{value:.2e}" if value else "0"


def extraction_table(extraction: Extraction, comparison: Comparison | None = None, title: str = "mhaextract") -> Table:
    """d, H, measured queries against the formula, longest query, errors (when the truth is known),
    canonical count, certificate, checks and seconds."""
    table = Table(title=title, show_header=True, header_style="bold")
    table.add_column("quantity")
    table.add_column("value", justify="right")
    table.add_column("note")
    e = extraction
    mode = "float64" if e.precision is None else f"{e.precision} bits"
    table.add_row("d", str(e.d), "")
    table.add_row("H (bound H0)", str(e.max_heads), f"schedule '{e.schedule}', {mode}")
    if e.schedule == "paper":
        formula = f"formula 4*H0*d^2 - 2*H0 + 1 = {e.promised_queries}"
        formula += "" if e.queries == e.promised_queries else "  MISMATCH"
    elif e.schedule == "targeted":
        formula = f"adaptive; paper 4*H0*d^2 - 2*H0 + 1 = {e.promised_queries} (ratio {e.queries / e.promised_queries:.2f})"
    else:
        formula = (f"lean formula {e.promised_queries} + {e.fallback_links} fallback links; "
                   f"paper {4 * e.max_heads * e.d**2 - 2 * e.max_heads + 1}; "
                   f"lower bound H*(d^2+d) = {e.heads * (e.d**2 + e.d)}")
    table.add_row("queries (measured)", str(e.queries), formula)
    bound = "at most" if e.schedule == "targeted" else "formula 2*H0 + 1 ="
    table.add_row("longest query", str(e.max_query_length), f"{bound} {e.promised_max_length}")
    table.add_row("canonical heads H*", str(e.heads), "")
    if comparison is not None:
        agree = "" if comparison.heads_agree else f"  truth has {comparison.heads_b} canonical heads"
        table.add_row("max rel. error W", _fmt(comparison.W_rel), "normwise, against the truth" + agree)
        table.add_row("max rel. error v", _fmt(comparison.v_rel), "")
    kind = "certified ball radius" if e.certified else ("ball radius (first order)" if e.precision else "first order")
    table.add_row("error estimate", _fmt(e.error_estimate), kind)
    table.add_row("answers residual", _fmt(e.answers_residual), "misfit on the queries asked")
    failed = e.failed_checks
    table.add_row("checks", "ok" if not failed else "FAILED",
                  ", ".join(check.name for check in failed) if failed else f"{len(e.checks)} passed")
    table.add_row("seconds", f"{e.seconds:.2f}", "oracle + learner")
    return table
