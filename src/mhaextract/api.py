"""``extract``: validate the common parameters once, pick a learner from the registry, run it in a session.

The data flow of one extraction::

    parameters -> Request (common) + family options -> learner (mhaextract.run.learner: named, or
        "auto": claimed) -> Session (boundaries, transcript, calibration, resume check)
        -> learner.run: answers -> heads -> Result -> session.finish: counts, raise or warn

Nothing here names a family: every family registers its learners (docs/adding-a-learner.md).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from . import families  # noqa: F401  (every family registers its learners on import)
from .checks.causality import records_causality
from .oracle.progress import one_bar_per_run
from .run.learner import COMMON, family_options
from .run.session import Request, run_learner

if TYPE_CHECKING:
    from .run.result import Result


@one_bar_per_run
@records_causality
def extract(oracle, d, heads=None, max_heads=None, precision=None, seed=None, *, schedule="auto", token_scale=None,
            batch_size=1024, progress=None, on_failure="raise", transcript=None, max_queries=None, resume_check=3,
            verify_length=None, **options) -> Result:
    """Learn the canonical heads of multi-head attention from value queries.

    Parameters
    ----------
    oracle : callable ``oracle(batch) -> outputs`` (see :mod:`mhaextract.oracle.boundary`).
    d : token dimension.
    heads : the number of heads H, if known. Exactly one of ``heads`` and ``max_heads``.
    max_heads : a bound H0 >= H*; the canonical count is detected on every instance (grid schedules:
        ``result.details.merge_resolution`` is the singular-value gap it was decided in).
    precision : None for float64; bits (>= 64) for the high-precision (python-flint) path.
    seed : None or an integer >= 0: seeds the random query vectors (same seed, same queries).
    schedule : ``"auto"`` (default: the registry chooses from the arithmetic and H0, and
        ``result.schedule_reason`` says what and why: targeted in float64 with H0 <= d, else the
        paper's grid, with biases the biased grid of docs/algorithm.md, 'Biases: affine scores and an output constant':
        ``4 H0 d^2 + 4 H0 d - 2 H0 + 1`` queries of length at most ``2 H0 + 1``) or a name
        from :mod:`mhaextract.attention.registry`: ``"paper"`` (exactly ``4 H0 d^2 - 2 H0 + 1`` queries of length at
        most ``2 H0 + 1``, docs/algorithm.md, 'The paper schedule'; named alone it reproduces the paper: bias-free
        model, token scale ``d ** 0.25``, no probes), ``"lean"`` ('The lean schedule': about ``(2 H0 - 1) d^2`` queries,
        heads matched by residue labels), ``"targeted"`` ('The targeted schedule': float64, H <= d, one head in the
        window per instance; machine precision for many heads, about ``4 H d^2 + 4 H d`` queries) or ``"lowrank"``
        ('Low-rank heads').
    token_scale : norm of the query vectors: ``"auto"`` (found by counted probe queries, 'Choosing the token scale from
        queries'; ``result.calibration_queries``), a number (choose it so that ``|z^T W_h x|`` is of order
        one, 'Numerics in float64 and the token scale'), or None (default: ``"auto"`` for ``"auto"``, ``"targeted"`` and
        ``"lowrank"``, ``d ** 0.25`` for the paper-model schedules, suited to W with entries of size ``1/sqrt(d)``).
    batch_size : sequences per oracle call.
    progress : draw one progress bar for the run on stderr: True, False, or None (default: only when
        stderr is a terminal, so a redirected log gets no bar lines). Its description names the
        stage being asked (calibration probes, the schedule's rounds, polish and probe queries,
        verification), with the queries asked against those expected and the time left.
    on_failure : ``"raise"`` an :class:`~mhaextract.checks.base.ExtractionError` when a check
        fails (the result is on the error), or ``"warn"`` and return it.
    transcript : path of a SQLite transcript (:mod:`mhaextract.oracle.transcript`), or None. Every
        batch of answers (the calibration's probes included) is committed to it as it arrives;
        re-running with the same transcript and seed reads them back and asks only the missing
        queries, so it re-pays at most the batch in flight and the resume check. Needs an integer ``seed``.
    max_queries : cap on the queries asked of the oracle in this run; when the run needs more it
        raises :class:`~mhaextract.oracle.boundary.BudgetExceeded` saying how many.
    resume_check : resuming a transcript, re-ask this many recorded queries (counted in
        ``queries_asked``) and refuse the transcript when the oracle answers differently
        (:mod:`mhaextract.oracle.resume_check`); 0 skips the check.
    verify_length : the default verification (docs/algorithm.md, 'Approximate answers: certificate, oversampling,
        refinement, verification'): 32 fresh random queries of lengths spread from 1 to ``verify_length`` tokens, asked
        after the schedule and counted like every query (``result.verification_queries``,
        ``result.verification_length``), judged by the ``long_verification`` check against the run's own error estimate
        and noise; a layer that is another model beyond short sequences (a sliding window, position-dependent scores)
        fails it. None (default): 256, except ``schedule="paper"`` named alone (0: the paper's
        exact count); an integer 1..4096; 0 turns it off.
    **options : the family options, keyword-only; each learner takes its own and refuses the rest
        before any query, naming the learner that takes it (``mhaextract schedules`` tables them):

        - ``bias``: learn score biases ``u_h`` and the output constant ``c`` ('Biases: affine scores and an output constant';
          real layers have them). None (default): True for ``"auto"``, ``"targeted"`` and ``"lowrank"``, False for the
          paper-model schedules (``"paper"``, ``"lean"``); ``schedule="paper", bias=True`` runs the biased grid (high
          precision: ``result.u_balls``, ``result.c_ball``).
        - ``samples_per_instance``: K >= 2 H0 + 1 copy counts per instance (float64, paper schedule).
        - ``refine``: polish all parameters (with ``bias``: u_h and c too) by least squares on fresh, counted
          polish queries (and the grid schedules' own answers), then certify the fit (float64, every
          schedule, 'Approximate answers: certificate, oversampling, refinement, verification'): ``result.certificate``,
          ``result.error_estimate`` from ``G = J^+``. None (default): only where the schedule refines by itself (float64
          paper and lean, when ``answer_error`` is declared or the answers show noise above rounding, and paper when its
          algebraic result failed a check; paper on its own answers, its exact count kept; lean
          with ``H0 (d^2 + d)`` polish queries; H0 <= 3; 'The lean schedule' and 'Approximate answers: certificate,
          oversampling, refinement, verification'); False: never.
        - ``refine_queries``: fresh polish queries for the refinement (default ``6 P``, P the parameters:
          ``6 H0 (d^2 + d)``, with biases ``6 (H0 (d^2 + 2d) + 1)``; at least 32).
        - ``answer_error``: a bound on every answer's absolute error, if known (float64).
        - ``rank``: a bound r on the rank of every ``W_h`` (``schedule="lowrank"``, 'Low-rank heads': about
          ``2.1 H (2dr - r^2)`` queries instead of ``4 H d^2``), or ``"auto"``: the schedule finds r from
          its bridges first (at most twice the full bridges r needs; ``details.rank``). With
          ``schedule="auto"`` a rank selects the low-rank schedule (float64, H0 <= d, with biases and
          calibration as the other defaults); the other schedules refuse it.
        - ``backend``: float64 kernels of the grid schedules (paper, lean): None or ``"numpy"``, or
          ``"torch"`` (CUDA when present, else CPU), ``"torch-cpu"``, ``"torch-cuda"``: the batched
          factorisations in torch, the same results to float64 rounding (needs the ``[torch]`` extra).
        - ``repair``: high precision, grid schedules: an instance whose Krawczyk test failed is measured
          again with its close poles pulled apart, with 0, K or 2K extra counted queries
          (docs/algorithm.md, 'Certificate repair: failed instances measured again with their poles pulled apart';
          ``result.details.repair_queries``, ``result.details.repairs``). None (default): on for the biased grid
          (``"auto"``, ``bias=True``), off for ``schedule="paper"`` named alone, whose count then stays the paper's
          exactly; True turns it on there; False turns it off.
        - ``positions``: ``"none"`` (default: the model of docs/algorithm.md, 'The model', no positions) or
          ``"rotary"``: rotary position embeddings (Llama-style RoPE, grouped-query heads, a sliding
          window found by queries; 'Rotary attention: positions, grouped heads and sliding windows'), learned with the
          rotary schedule in float64, or taken on to ``precision`` bits for an oracle answering ``mpf``; returns a
          :class:`~mhaextract.rotary.learn.RotaryExtraction` whose ``model`` is a
          :class:`~mhaextract.RotaryAttention`. It takes ``heads``, ``precision``, ``seed``,
          ``token_scale``, ``bias`` (the query bias; default True), ``rank`` (the head width),
          ``batch_size``, ``progress``, ``on_failure``, ``max_queries``, ``verify_length``,
          ``key_bias``, ``polish_factor`` (the refinement's fresh queries per parameter, default 3) and
          ``value_factor`` (times the value fit's read-out queries, default 1): more answers average more of
          their rounding.
        - ``norm``: ``"auto"``, ``"layernorm"`` or ``"rmsnorm"``: the oracle is the attention sublayer of a
          pre-norm block (a norm before the attention, the residual around it; GPT-2's ``ln_1`` + ``attn``,
          a ViT's, ``mhaextract.adapters.normed.attention_sublayer(block)``), learned by the ``norm`` learner
          (docs/algorithm.md, 'Attention behind a norm: the sublayer of a block'; docs/norm.md): the norm's kind
          and eps and the residual from one-token sweeps, the heads by a direct fit from tokens the norm can
          reach, the whole sublayer checked on raw sequences; returns a ``NormedExtraction`` whose ``model`` is
          a :class:`~mhaextract.models.normed.NormedAttention`. Needs ``heads``. ``inner_schedule``: ``"fit"``
          (default) or an attention schedule's name run on the reduced oracle. ``"post-layernorm"`` (or
          ``"auto"`` finding it): a post-norm block's (BERT's ``BertAttention``: attention, residual, then a
          LayerNorm), gamma and beta from the answers' ellipsoid and every parameter by a direct fit; its
          ``model`` a :class:`~mhaextract.models.normed.PostNormAttention`. Without ``norm=``, a failed
          ``"auto"`` run whose model-class probes find a norm before the attention goes on as this learner with
          ``norm="auto"`` (same session and transcript; ``result.schedule_reason`` says why).
        - ``key_bias``: ``positions="rotary"`` only: the keys carry a bias (Qwen2), which under rotation
          does not cancel in the softmax. The run first finds a token whose key is zero from whole
          answers (float64: grouped-query heads with ``n_kv r < d`` and ``H r <= d``, 'A key bias'; float32: by
          large-query finals, counts up to 2048, "From float32 answers"), asks everything else at tokens shifted by it and
          fits the key bias in the refinement (``result.neutral``). Default False: a key-biased layer then fails its
          checks.

    Returns
    -------
    Result
        The learner's result (a :class:`~mhaextract.run.result.Result`: the canonical heads and
        every measured count, check and error estimate, each count measured at the oracle
        boundary; ``result.schedule`` names the learner that ran). The attention schedules return
        an :class:`~mhaextract.Extraction`; a layer answering whole outputs in bfloat16 or float16
        (its ``answer_dtype``, or the answers' bits) a :class:`~mhaextract.LowPrecisionExtraction`
        (docs/algorithm.md, 'Whole answers at 8 or 11 bits: saturated lines, then least squares');
        ``positions="rotary"`` a :class:`~mhaextract.RotaryExtraction`; ``schedule="vector"`` a
        :class:`~mhaextract.VectorExtraction` where the answers split by head.

    Examples
    --------
    The defaults (targeted schedule in float64, biases, token scale found by 147 probe queries):

    >>> import mhaextract as mx
    >>> target = mx.MultiHeadAttention.random(d=4, heads=2, seed=0, bias=True)
    >>> result = mx.extract(mx.SimulatedOracle(target), d=4, heads=2, seed=1)
    >>> result.schedule, result.heads, result.ok, result.calibration_queries
    ('targeted', 2, True, 147)
    >>> bool(mx.compare(result.model, target).max_rel < 1e-12)
    True

    ``schedule="paper"`` named alone reproduces the paper: exactly ``4Hd^2 - 2H + 1`` queries:

    >>> target = mx.MultiHeadAttention.random(d=3, heads=2, seed=0)
    >>> result = mx.extract(mx.SimulatedOracle(target), d=3, heads=2, seed=1, schedule="paper")
    >>> result.queries, 4 * 2 * 3**2 - 2 * 2 + 1, result.max_query_length
    (69, 69, 5)

    Every learner of the registry, its family and the options it takes:
    :func:`mhaextract.run.learner.options_table` (``mhaextract schedules`` prints it).
    """
    request = Request.validated(d, heads, max_heads, precision, seed, token_scale)
    return run_learner(oracle, request, schedule, _family_options(options), batch_size=batch_size, progress=progress,
                       on_failure=on_failure, transcript=transcript, max_queries=max_queries,
                       resume_check=resume_check, verify_length=verify_length)


def _family_options(options: dict) -> dict:
    """``options`` checked against every option some learner takes (a TypeError naming an unknown one)."""
    known = family_options()
    unknown = sorted(set(options) - known)
    if unknown:
        raise TypeError(f"extract() got unexpected keyword argument(s) {', '.join(map(repr, unknown))}; the options "
                        f"learners take are {', '.join(sorted(known | set(COMMON)))}")
    return options
