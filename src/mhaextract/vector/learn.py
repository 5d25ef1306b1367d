"""The run on whole answers near the vector bound (docs/algorithm.md, 'Whole answers near the vector
bound'): the value map, the split, the scores, the refinement, the error estimate and the checks.

:func:`extract_vector` is what :func:`mhaextract.extract` runs for ``schedule="vector"`` when the
answers are whole float32 or float64 vectors and H is declared; :class:`SplitUnavailable` (raised
before any model exists) sends the run back to the scalar schedules, with the reason.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import ClassVar

import numpy as np

from ..checks.verify import ask_long_verification, fresh_queries, spread_lengths
from ..oracle.boundary import BudgetExceeded, OracleError
from ..oracle.progress import note_progress
from ..run.result import Result
from ..run.validation import spawn_rng
from .factored import FactoredLayer, forward, grouped
from .refine import refine, refine_scores
from .scores import (OVERSAMPLED, PHASE_ONE, REFINED_DESIGN, UNREFINED, learn_scores, score_queries, score_rank,
                     tokens_per_query)
from ..split.subspaces import _Saturated, output_subspaces
from ..split.estimate import error_estimate, estimate_limit, relative_misfits, split_checks
from ..split.values import SplitUnavailable, more_bases, value_map

#: Every parameter is refined on every answer when one Jacobian product costs at most this many
#: multiply-adds (n H N (k + r) d): GPT-2-class layers up to d = 128, H = 8; larger layers
#: refine only the scores' parameters (see the docs).
REFINE_WORK = 1e9
#: The scores-only refinement runs when one of its Jacobian products costs at most this many
#: multiply-adds (``2 n H d (N + r)`` over the oversampled design's answers: up to d = 256, H = 8, about
#: 15 s a step on one core); larger layers keep the start (the ``UNREFINED`` design).
SCORE_REFINE_WORK = 2e9
#: Answers rounded at this unit or coarser (float32) ask the oversampled score design
#: (``OVERSAMPLED``) even where every parameter is refined: their score parameters are limited by
#: the information in the answers, not by the refinement (docs/algorithm.md, 'Whole answers near
#: the vector bound', 'The score design by what follows').
COARSE_UNIT = 2.0 ** -30
#: Held-out queries for the error estimate: lengths 1..HOLDOUT_LONGEST, tokens at the run's token scale
#: (the largest norm the estimate speaks for: the model's error grows with the token norm).
HOLDOUT_QUERIES, HOLDOUT_LONGEST, HOLDOUT_SCALES = 32, 64, (1.0,)
#: Random streams of the run's seed (:func:`mhaextract.run.validation.spawn_rng`), apart from the others'.
STREAMS = {"values": 41, "split": 42, "scores": 43, "holdout": 44, "refine": 45}


def vector_bound(d: int, heads: int, rank: int, d_out: int) -> int:
    """``ceil(P / d_out)``, P the canonical layer's real parameters with heads of width r:
    ``H (2 d r - r^2 + d + (d + d_out) r - r^2) + d_out`` (the information bound of whole answers)."""
    parameters = heads * (2 * d * rank - rank ** 2 + d + (d + d_out) * rank - rank ** 2) + d_out
    return -(-parameters // d_out)


@dataclass(kw_only=True, repr=False)  # Result's one-line repr
class VectorExtraction(Result):
    """Result of :func:`mhaextract.extract` on whole answers split by head (``schedule == "vector"``):
    the common fields of :class:`~mhaextract.Result` (``model`` a whole
    :class:`~mhaextract.MultiHeadAttention`, ``V`` (H, d_out, d) and ``c`` (d_out,);
    ``error_estimate`` the largest output error expected at every position of fresh sequences of up
    to 64 tokens with token norms up to ``token_scale``, relative to each query's largest output:
    ``ESTIMATE_FACTOR`` times the largest misfit on held-out queries at the token scale
    (:func:`error_estimate`; docs/algorithm.md, 'Whole answers near the vector bound', 'The error estimate');
    ``answers_residual`` the RMS misfit on the fitted answers, relative to their RMS), and:

    Attributes
    ----------
    vector_bound : ``ceil(P / d_out)`` for the heads' measured widths (:func:`vector_bound`).
    value_ranks, score_ranks : per head, rank V_h and rank [W_h | u_h].
    split_conditioning : the condition number of [O_1 .. O_H].
    refined : whether a Gauss-Newton refinement ran.
    refinement : ``"full"`` (every parameter on every answer), ``"scores"`` (the scores' parameters,
        each head against its coordinates of the answers, for layers where the full one costs too much)
        or ``""`` (none: the oversampled start, for layers where that costs too much as well).

    Examples
    --------
    >>> import numpy as np
    >>> import mhaextract as mx
    >>> scores = mx.MultiHeadAttention.random(d=6, heads=2, seed=4, bias=True, rank=3, d_out=6)
    >>> rng = np.random.default_rng(104)  # values of rank 3 too: the outputs have room for both heads
    >>> V = np.einsum("hor,hrd->hod", rng.standard_normal((2, 6, 3)), rng.standard_normal((2, 3, 6)))
    >>> layer = mx.MultiHeadAttention(scores.W, V / np.sqrt(3), scores.u, scores.c)
    >>> result = mx.extract(mx.SimulatedOracle(layer), 6, heads=2, seed=2, schedule="vector")
    >>> result.schedule, result.value_ranks, result.ok, bool(mx.compare(result.model, layer).max_rel < 1e-12)
    ('vector', [3, 3], True, True)
    """

    vector_bound: int = 0
    value_ranks: list = field(default_factory=list)
    score_ranks: list = field(default_factory=list)
    split_conditioning: float = float("nan")
    refined: bool = False
    refinement: str = ""

    error_measure: ClassVar[str] = "outputs"
    _repr_fields: ClassVar[tuple[str, ...]] = ("vector_bound",)

    @property
    def d_out(self) -> int:
        return 0 if self.model is None else self.model.d_out

    def _summary_extra(self) -> dict:
        return {"d_out": self.d_out, "vector_bound": self.vector_bound, "split_conditioning": self.split_conditioning,
                "refined": self.refined, "refinement": self.refinement}


def holdout_queries(rng: np.random.Generator, d: int, scale: float) -> list[np.ndarray]:
    """The error estimate's ``HOLDOUT_QUERIES`` fresh queries: lengths spread from 1 to
    ``HOLDOUT_LONGEST``, Gaussian tokens of norm about ``HOLDOUT_SCALES`` times the token scale."""
    return fresh_queries(rng, spread_lengths(HOLDOUT_QUERIES, HOLDOUT_LONGEST), d, scale, HOLDOUT_SCALES)


def _padded(arrays: list[np.ndarray], shape: tuple[int, ...]) -> np.ndarray:
    out = np.zeros((len(arrays),) + shape)
    for index, array in enumerate(arrays):
        out[(index,) + tuple(slice(0, size) for size in array.shape)] = array
    return out


def _start(split, K, G, beta, c, d: int, d_out: int) -> FactoredLayer:
    k, r = max(basis.shape[1] for basis in K), max(split.ranks)
    return FactoredLayer(_padded(K, (d, k)), _padded(G, (k, d)), _padded(beta, (k,)), _padded(split.O, (d_out, r)),
                         _padded(split.P, (r, d)), np.array(c, dtype=np.float64))


def full_refinement_work(d: int, ranks: list[int], design: tuple[float, float]) -> float:
    """Multiply-adds of one Jacobian product of :func:`refine` over the queries the run will have
    (``n H N (k + r) d``, k taken as r)."""
    n = d + 1 + score_queries(d, ranks, design)
    return float(n * len(ranks) * (tokens_per_query(ranks) + 1) * d * 2 * max(ranks))


def score_design(unit: float, route: str) -> tuple[float, float]:
    """The score queries' design for answers rounded at ``unit`` and the refinement ``route`` that
    follows (:func:`refinement_route`): ``UNREFINED`` where none follows, ``REFINED_DESIGN[route]``
    for float64 answers that are refined, ``OVERSAMPLED`` for float32 and coarser (``COARSE_UNIT``)."""
    if not route:
        return UNREFINED
    return REFINED_DESIGN[route] if unit < COARSE_UNIT else OVERSAMPLED


def refines_fully(d: int, ranks: list[int], unit: float) -> tuple[bool, float]:
    """``(whether every parameter is refined on every answer, the work of one Jacobian product)``
    for heads of value ranks ``ranks`` on answers rounded at ``unit`` (``REFINE_WORK``)."""
    work = full_refinement_work(d, ranks, score_design(unit, "full"))
    return work <= REFINE_WORK, work


def score_refinement_work(n: int, d: int, ranks: list[int]) -> float:
    """Multiply-adds of one product of :func:`refine_scores` over n answers (``2 n H d (N + r)``)."""
    return float(2 * n * len(ranks) * d * (tokens_per_query(ranks) + 1 + max(ranks)))


def refines_scores(d: int, ranks: list[int]) -> tuple[bool, float]:
    """``(whether the scores-only refinement runs where the full one does not, the work of one of its
    products)`` over the answers of the oversampled design (``SCORE_REFINE_WORK``)."""
    work = score_refinement_work(d + 1 + score_queries(d, ranks, OVERSAMPLED), d, ranks)
    return work <= SCORE_REFINE_WORK, work


#: Queries per product of the residual's forward pass (its working memory: B H (N + d) numbers).
FORWARD_CHUNK = 512


class FittedQueries:
    """The unsaturated queries the model is fitted to (the value map's, the pilots' and the scores')
    and their whole answers. The score batches draw their tokens again when asked (:class:`ScoreBatch`),
    so a run that is not refined never holds every score query's tokens at once."""

    def __init__(self, sequences: list, answers: np.ndarray, batches: list):
        self.first, self.batches = (list(sequences), answers), batches
        self.answers = np.concatenate([answers] + [batch.answers for batch in batches])
        start = len(answers)
        for batch in batches:  # each batch's answers a view of the whole: held once (a float32 d = 768 run: 600 MB)
            batch.answers, start = self.answers[start:start + len(batch.answers)], start + len(batch.answers)

    def __len__(self) -> int:
        return len(self.answers)

    def sequences(self) -> list:
        """Every query's tokens at once, in the order of :attr:`answers` (the refinement's data)."""
        return list(self.first[0]) + [X for batch in self.batches for X in batch.X]

    def groups(self):
        """``(indices into answers, tokens (B, N, d))`` per query length, a batch at a time: a score
        batch's queries have one length, its tokens one array as drawn."""
        yield from grouped(self.first[0])
        done = len(self.first[0])
        for batch in self.batches:
            yield np.arange(done, done + len(batch.answers)), batch.X
            done += len(batch.answers)

    def outputs(self, layer: FactoredLayer) -> np.ndarray:
        """The layer's outputs on every query, a batch at a time (in factored form: ``W_h = K_h G_h`` of
        rank k costs ``2 d k`` a head and query instead of ``d^2``)."""
        out = np.empty_like(self.answers)
        for index, X in self.groups():
            for start in range(0, len(index), FORWARD_CHUNK):
                chunk = X[start:start + FORWARD_CHUNK].astype(np.float64)  # float32 score tokens
                out[index[start:start + FORWARD_CHUNK]] = forward(layer, chunk).f
        return out


def no_room(d: int, heads: int, rank: int | None, d_out: int) -> str | None:
    """Why H heads (of width ``rank`` where known) cannot be split in ``d_out`` numbers from tokens of
    dimension ``d``, or None where they can (the split's first requirements): the heads need
    independent output subspaces, and the saturated queries' final tokens a half circle, two
    dimensions (:func:`~mhaextract.split.subspaces.output_subspaces`)."""
    if d < 2:
        return f"d = {d}: the saturated queries' half circles of final tokens need d >= 2"
    if heads > d_out:
        return f"H = {heads} heads cannot have independent output subspaces in d_out = {d_out}"
    if rank is not None and heads * rank > d_out:
        return f"H rank = {heads * rank} > d_out = {d_out}: the heads' output subspaces cannot be independent"
    return None


#: Where no refinement follows (the split's start is the model), V_tot is the mean over this many
#: random bases of one-token queries (:func:`~mhaextract.split.values.more_bases`).
UNREFINED_VALUE_BASES = 4


def refinement_route(d: int, ranks: list[int], unit: float) -> str:
    """What will fit the model after the split, for heads of value ranks ``ranks`` on answers rounded at
    ``unit``: ``"full"`` (:func:`refines_fully`), ``"scores"`` (:func:`refines_scores`) or ``""`` (none:
    the split's start is the model, and the split asks for the precision itself)."""
    if refines_fully(d, ranks, unit)[0]:
        return "full"
    return "scores" if refines_scores(d, ranks)[0] else ""


def learn_split(boundary, seed, d: int, heads: int, scale: float, unit: float, progress=None):
    """The start: ``(layer, fitted, split, score ranks, route)`` (``fitted``: the unsaturated queries
    and their whole answers, :class:`FittedQueries`, which the refinement fits; ``route``: the refinement
    that follows, :func:`refinement_route`, whose score design was asked). SplitUnavailable when the split
    cannot work."""
    values_rng = spawn_rng(seed, STREAMS["values"])
    values = value_map(boundary, values_rng, d, scale)
    d_out = values.c.shape[0]
    why = no_room(d, heads, None, d_out)
    if why:
        raise SplitUnavailable(why)
    note_progress(progress, "whole answers: saturated queries for the heads' output subspaces")
    split = output_subspaces(_Saturated(boundary, values, unit), spawn_rng(seed, STREAMS["split"]), d, d_out,
                             scale, heads, values, unit, lambda ranks: refinement_route(d, ranks, unit),
                             lambda: more_bases(values, boundary, values_rng, d, scale, UNREFINED_VALUE_BASES - 1))
    note_progress(progress, "whole answers: every head's attention weights")
    route = refinement_route(d, split.ranks, unit)
    K, G, beta, batches, _ = learn_scores(boundary, spawn_rng(seed, STREAMS["scores"]), d, scale, split, values.c,
                                          unit, score_design(unit, route), PHASE_ONE[route])
    return (_start(split, K, G, beta, values.c, d, d_out), FittedQueries(values.sequences, values.answers, batches),
            split, [k.shape[1] for k in K], route)


def _refined(layer: FactoredLayer, widths: list[int], sequences, answers: np.ndarray, seed, unit: float,
             refinement: str, progress) -> tuple[FactoredLayer, list[int]]:
    """``(layer, score ranks)``: the refinement of the start (every parameter, or the scores' only), then, where a head's refined
    ``[W_h | u_h]`` has fewer directions above the rank cut than its start (score vectors read where
    ``u_h`` dominates put float32's noise beside the weak directions of ``W_h``, so phase 1 kept noise
    directions), the layer cut to those directions and refined again: a direction fitted to noise
    leaves the answers' least squares ill-conditioned (docs/algorithm.md, 'Whole answers near the
    vector bound', 'The score rank after the refinement')."""
    def refined(layer: FactoredLayer) -> FactoredLayer:
        return (refine if refinement == "full" else refine_scores)(
            layer, sequences, answers, spawn_rng(seed, STREAMS["refine"]), on_step=lambda step, misfit: note_progress(
                progress, f"whole answers: Gauss-Newton step {step} ({refinement}), misfit {misfit:.3g}")).layer

    layer = refined(layer)
    ranks = [score_rank(K[:, :width] @ np.concatenate([G[:width], b[:width, None]], axis=1), unit)
             for K, G, b, width in zip(layer.K, layer.G, layer.beta, widths)]
    if ranks != widths:
        layer, widths = refined(layer.truncated_scores(ranks)), ranks
    return layer, widths


def extract_vector(boundary, seed, d: int, heads: int, scale: float, unit: float, answer_dtype: str,
                   verify_length: int | None = None, progress=None) -> VectorExtraction:
    """The run of the module docstring on ``boundary`` (whole answers; its checks unreported:
    ``extract`` raises or warns). ``unit``: the answers' relative rounding."""
    started = time.perf_counter()
    layer, fitted, split, score_ranks, refinement = learn_split(boundary, seed, d, heads, scale, unit, progress)
    m = tokens_per_query(split.ranks)
    answers = fitted.answers
    if refinement:
        layer, score_ranks = _refined(layer, score_ranks, fitted.sequences(), answers, seed, unit, refinement,
                                      progress)
    model = layer.model()
    squares = fitted.outputs(layer)  # squared misfits, then squared answers, in one buffer the size of the answers
    squares -= answers
    np.square(squares, out=squares)
    misfit = np.mean(squares)
    np.square(answers, out=squares)
    residual = float(np.sqrt(misfit) / np.sqrt(np.mean(squares)))
    holdout = holdout_queries(spawn_rng(seed, STREAMS["holdout"]), d, scale)
    try:
        held = np.asarray(boundary.ask(holdout, "whole answers: held-out queries for the error estimate", whole=True))
    except Exception as error:  # a bad answer or the oracle's own exception: say which queries these were
        if (isinstance(error, OracleError) and not isinstance(error, BudgetExceeded)
                or getattr(error, "raised_by_oracle", False)):
            error.add_note(f"mhaextract: these are the split's {HOLDOUT_QUERIES} held-out queries of 1.."
                           f"{HOLDOUT_LONGEST} tokens for its error estimate (docs/algorithm.md, 'Whole answers near "
                           "the vector bound', 'The error estimate'); for an oracle that cannot answer sequences "
                           "that long, schedule='targeted' with verify_length=L asks none longer than L")
        raise
    estimate = error_estimate(float(relative_misfits(model, holdout, held).max()), unit, HOLDOUT_LONGEST)
    limit = estimate_limit(answer_dtype, unit)
    checks = split_checks(split, residual, 1e3 * unit, estimate, limit, "the unsaturated answers",
                          f"fresh queries up to the token scale ({HOLDOUT_QUERIES} held out)")
    verification = None
    if verify_length is None or verify_length > 0:
        long_queries = ask_long_verification(boundary, spawn_rng(seed, 5), scale, verify_length or 256)
        largest = float(np.abs(long_queries.whole).max())
        check, verification = long_queries.judge(model, estimate, residual, 0.0, largest, unit, m + 1, seed=seed)
        checks.append(check)
    d_out = answers.shape[1]
    return VectorExtraction(
        model=model, heads=model.heads, d=d, seed=seed, schedule="vector",
        verification_queries=0 if verification is None else verification.queries,
        verification_length=0 if verification is None else verification.lengths[1],
        queries=boundary.queries + boundary.replayed,
        queries_asked=boundary.queries, queries_replayed=boundary.replayed,
        max_query_length=boundary.max_query_length, answer_dtype=answer_dtype, token_scale=float(scale),
        error_estimate=float(estimate), answers_residual=residual, seconds=time.perf_counter() - started,
        checks=checks, verification=verification,
        vector_bound=vector_bound(d, heads, max(split.ranks), d_out), value_ranks=list(split.ranks),
        score_ranks=score_ranks, split_conditioning=split.conditioning, refined=bool(refinement), refinement=refinement)
