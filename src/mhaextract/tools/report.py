"""Tables for people: a run's summary as a rich table."""

from __future__ import annotations

from rich.table import Table

from ..models.compare import Comparison
from ..run.result import Extraction


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
    formula = f"{e.promised_formula} = {e.promised_queries}"
    value_fit = 0 if e.value_fit is None else e.value_fit.rows
    asked_by_schedule = (e.queries - (e.refinement.queries if e.refinement is not None else 0)
                         - e.calibration_queries - e.verification_queries - value_fit)
    formula += f" (the schedule's measured/formula {asked_by_schedule / max(e.promised_queries, 1):.3f})"
    if e.refinement is not None:
        formula += f" + {e.refinement.queries} refinement queries"
    table.add_row("queries (measured)", str(e.queries), formula)
    if e.transcript is not None:
        table.add_row("asked / replayed", f"{e.queries_asked} / {e.queries_replayed}",
                      f"this run / read back from {e.transcript}")
    longest = f"the schedule's promise: at most {e.promised_max_length}"
    if e.verification_length:
        longest += f"; the verification's queries reach {e.verification_length} (docs/algorithm.md §12.2)"
    table.add_row("longest query", str(e.max_query_length), longest)
    table.add_row("token scale", f"{e.token_scale:.4g}", "norm of the query tokens" if e.calibration is None
                  else f"{e.calibration} (calibration queries: {e.calibration_queries}, in the count)")
    if e.schedule_reason:
        table.add_row("schedule choice", e.schedule, e.schedule_reason)
    for name, value in e.details.summary().items():
        shown = f"{value:.3g}" if isinstance(value, float) else str(value)
        table.add_row(name.replace("_", " "), shown, f"schedule '{e.schedule}'")
    table.add_row("canonical heads H*", str(e.heads), "")
    if e.d_out is not None:
        table.add_row("outputs per answer", str(e.d_out), "whole answers: the model has V_h (d_out x d) and c (d_out)")
        if e.value_fit is not None:
            table.add_row("value fit", f"{e.value_fit.rows} queries",
                          f"residual {_fmt(e.value_fit.residual)}, estimate {_fmt(e.value_fit.error_estimate)}, "
                          f"|V^T r - v| {_fmt(e.value_fit.readout_gap)} (docs/algorithm.md §21)")
    if comparison is not None:
        agree = "" if comparison.heads_agree else f"  truth has {comparison.heads_b} canonical heads"
        table.add_row("max rel. error W", _fmt(comparison.W_rel), "normwise, against the truth" + agree)
        table.add_row("max rel. error v", _fmt(comparison.v_rel), "")
        if e.bias:  # the estimate below covers these too (compare's max_rel)
            table.add_row("max rel. error u", _fmt(comparison.u_rel), "to the truth's max |u| (absolute if it has none)")
            table.add_row("rel. error c", _fmt(comparison.c_rel), "to the truth's |c| (absolute if c = 0)")
    kind = "certified ball radius" if e.certified else ("ball radius (first order)" if e.precision else "first order")
    proven = getattr(getattr(e.details, "instances", None), "certified", None)
    if e.precision and not e.certified and proven is not None:  # what is proven, what estimated (§7)
        kind = f"ball radius: {int(proven.sum())} of {len(proven)} instances proven, the rest first order"
    table.add_row("error estimate", _fmt(e.error_estimate), kind)
    table.add_row("answers residual", _fmt(e.answers_residual), "misfit on the queries asked")
    if e.certificate is not None:
        method = "" if e.certificate.method == "exact" else f" ({e.certificate.method}, docs/algorithm.md §12.1)"
        table.add_row("amplification C", _fmt(e.amplification), f"first order, {e.certificate.kind} result{method}")
        table.add_row("valid below", _fmt(e.valid_below), "answer error under which the certificate holds")
        table.add_row("noise estimate", _fmt(e.certificate.noise_estimate), "std. dev. of the answers' errors, from the data")
        if e.answer_error is not None:
            table.add_row("error bound", _fmt(e.error_bound(e.answer_error)), f"at answer_error = {e.answer_error:.3g}")
    if e.refinement is not None:
        table.add_row("refinement", e.refinement.kept, f"rms misfit {e.refinement.residual_before:.2e} -> "
                      f"{e.refinement.residual_after:.2e}")
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


def transformer_table(extraction, comparison=None, title: str = "mhaextract transformer") -> Table:
    """The same kind of table for :func:`mhaextract.extract_transformer`: sizes, measured queries by
    step against the step-1 formula, longest query, errors against the truth, checks, seconds."""
    table = Table(title=title, show_header=True, header_style="bold")
    table.add_column("quantity")
    table.add_column("value", justify="right")
    table.add_column("note")
    e, a = extraction, extraction.attention
    mode = "float64" if e.precision is None else f"{e.precision} bits"
    table.add_row("d", str(e.d), "")
    table.add_row("H (bound H0)", str(a.max_heads), mode)
    table.add_row("queries of f (measured)", str(e.queries), "odd part + units + verification")
    asked = a.queries - e.odd_part_queries_reused
    table.add_row("  odd part g", str(e.queries_odd_part),
                  f"2 x {asked} queries of g, {a.schedule} schedule ({a.promised_formula})"
                  + (f", of them {e.queries_residual_term} measuring the residual term" if e.residual else ""))
    search = e.search
    if search is not None:
        table.add_row("  units", str(e.queries_units),
                      f"{search.segments} segments: grid {search.queries_grid}, kink probes {search.queries_confirm}, "
                      f"region fits {search.queries_regions}"
                      + (f", random rows for the polish {search.queries_spread}" if search.queries_spread else ""))
    table.add_row("  verification", str(e.queries_verification), "fresh random queries")
    table.add_row("longest query", str(e.max_query_length), "")
    table.add_row("canonical heads H*", str(e.heads), "")
    table.add_row("hidden units found", str(e.hidden), "")
    if comparison is not None:
        agree = []
        if not comparison.heads_agree:
            agree.append(f"truth has {comparison.heads_b} heads")
        if not comparison.units_agree:
            agree.append(f"truth has {comparison.units_b} units")
        if not comparison.signs_agree:
            agree.append("unit signs differ")
        table.add_row("max rel. error W", _fmt(comparison.W_rel), "normwise, against the truth")
        table.add_row("max rel. error units", _fmt(comparison.units_rel), "|w_j| A_j O_h, aligned; " + ", ".join(agree))
    table.add_row("verification misfit", _fmt(e.verification_misfit), "max |model - f| / max |f|, fresh queries")
    failed = e.failed_checks
    table.add_row("checks", "ok" if not failed else "FAILED",
                  ", ".join(check.name for check in failed) if failed else f"{len(e.checks)} passed")
    table.add_row("seconds", f"{e.seconds:.2f}", "oracle + learner")
    return table
