"""Tables for people: a run's summary as a rich table, for the result of any family."""

from __future__ import annotations

from rich.table import Table

from ..run.result import Result


def _fmt(value) -> str:
    value = float(value)
    return f"{value:.2e}" if value else "0"


def extraction_table(extraction: Result, comparison=None, title: str = "mhaextract") -> Table:
    """The common fields of any result (:class:`~mhaextract.Result`: d, the schedule, the measured
    queries, the longest query, the token scale, heads, error estimate, residual, verification,
    checks, seconds), the rows its family adds (``report_rows``), and with ``comparison`` (from
    :func:`mhaextract.compare` against the truth) its ``max_rel``."""
    table = Table(title=title, show_header=True, header_style="bold")
    table.add_column("quantity")
    table.add_column("value", justify="right")
    table.add_column("note")
    e = extraction
    mode = "float64" if e.precision is None else f"{e.precision} bits"
    table.add_row("d", str(e.d), "")
    table.add_row("schedule", e.schedule, f"{mode}, answers in {e.answer_dtype}")
    table.add_row("queries (measured)", str(e.queries), "answers used, counted at the oracle boundary"
                  + (f" (calibration queries: {e.calibration_queries})" if e.calibration_queries else ""))
    if e.transcript is not None:
        table.add_row("asked / replayed", f"{e.queries_asked} / {e.queries_replayed}",
                      f"this run / read back from {e.transcript}")
    table.add_row("longest query", str(e.max_query_length),
                  f"the verification's queries reach {e.verification_length}" if e.verification_length else "")
    table.add_row("token scale", f"{e.token_scale:.4g}", "norm of the query tokens")
    if e.schedule_reason:
        table.add_row("schedule choice", e.schedule, e.schedule_reason)
    for row in e.report_rows(comparison):
        table.add_row(*row)
    table.add_row("canonical heads H*", str(e.heads), "")
    if comparison is not None:
        table.add_row("max rel. error", _fmt(comparison.max_rel), "against the truth, aligned (compare's max_rel)")
    table.add_row("error estimate", _fmt(e.error_estimate), "expected relative error (inf: none made)")
    table.add_row("answers residual", _fmt(e.answers_residual), "misfit on the queries asked")
    if e.verification is not None:
        v = e.verification
        table.add_row("verification", "passed" if v.passed else "FAILED",
                      f"{v.queries} fresh queries: max rel. output error {v.max_relative_error:.2e}, mean "
                      f"{v.mean_relative_error:.2e}")
    failed = e.failed_checks
    table.add_row("checks", "ok" if not failed else "FAILED",
                  ", ".join(check.name for check in failed) if failed else f"{len(e.checks)} passed")
    table.add_row("seconds", f"{e.seconds:.2f}", "oracle + learner")
    return table
