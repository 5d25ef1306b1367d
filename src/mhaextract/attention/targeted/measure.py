"""Measuring units of targeted instances (docs/algorithm.md, 'The targeted schedule'): the instances asked chunk by
chunk, the single-pole fits, and each unit's ``a_h(z)`` with its first-order errors.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import numpy as np

from ...numerics import single_pole
from .designs import FullDesign, SubspaceDesign
from .patterns import correction_blocks
from .prober import Prober
from .tolerances import CORRECTION_BLOCK, EPS, FINAL_COPIES, INVERSE_BLOCK_BYTES

#: Noisy answers: the score rounding taken as ``NOISY_SCORE_FACTOR unit |z| |W x|`` (float64:
#: ``SCORE_FACTOR``) and the samples' modelled rounding scaled to the fits' residuals, at least by this.
NOISY_SCORE_FACTOR, NOISY_SAMPLE_FLOOR = 1.0, 1e-2
#: float64 answers: the oracle's score rounding taken as this many units of ``|z| |W x|`` per instance, a
#: standard deviation (docs/algorithm.md, 'The targeted schedule', 'Error estimate': the final instances'
#: log-pole errors measured against the truth are at most 0.8 of it, 0.1..0.2 in root mean square).
SCORE_FACTOR = 4.0
#: Working memory of one chunk of units in :func:`measure_units` (three (units, d, d) float64 arrays).
CHUNK_BYTES = 2**28
#: A stage whose final tokens take at most this many bytes keeps them, and its instances' margins
#: are then computed exactly rather than bounded (:func:`instance_diagnostics`).
KEEP_BYTES = 2**24
#: A stage whose tokens are not kept keeps, per token, its coordinates in the span of its unit's design
#: estimates and mean token (H + 1 numbers) and its norm off that span, when those take at most this many
#: bytes: the margins are then bounded exactly within that span and by Cauchy-Schwarz only off it
#: (:func:`span_coordinates`).
SPAN_BYTES = 2**28
#: The bridges' tolerance (log-pole units): their misfits come from the bridge step itself
#: (``eps |a_h| |x| <= 2``, :func:`bridge_step`), and a one-sample
#: reading's error grows only as ``e^misfit`` at the window's edge, less than the corrections'
#: Gram-Schmidt costs; beyond it (a prior far off) they are corrected as the other stages are.
BRIDGE_AIM_TOLERANCE = 1.0


@dataclass
class GroupMeasurements:
    """All instances of some units (g, h): head h with difference ``differences[g, h]``, d rounds each.
    Arrays (G, H, d rounds) unless noted. The final tokens themselves are not kept (memory): what
    the checks need of them is reduced per chunk of units (``a``, ``misfit``, ``margin``, ``x_norm``)."""

    differences: np.ndarray  # (G, H, d)
    #: (G, H, H, d) the a_f of every head used for the design (the target's before correction): an
    #: array, a broadcast view or :class:`HeadsAt`, read a slice of groups at a time
    estimates: object
    log_pole: np.ndarray
    label: np.ndarray
    designed: np.ndarray
    residual: np.ndarray
    sigma_m: np.ndarray
    sigma_l: np.ndarray
    gaps: np.ndarray  # (G, H, d, K) the samples G(k) (NaN where not asked)
    rounding: np.ndarray  # (G, H, d, K) their rounding scales
    ks: np.ndarray  # (G, H, d, K) their copy counts (NaN where not asked)
    a: np.ndarray  # (G, H, d) a_h(z) solved from the d log-poles (NaN unless all finite)
    misfit: np.ndarray  # |m_n - a^T x_n|
    margin: np.ndarray  # smallest other head's log-pole by the design estimates
    x_norm: np.ndarray  # |x_n|
    #: (G, H, D, 2) the first-order variance of each coordinate i of the solved ``a`` (D = d, or d + 1
    #: lifted), ``sum_n (X^{-1})_{in}^2 sigma_n^2`` (final stage; NaN otherwise): [..., 0] every
    #: term, [..., 1] the part that does not grow with answer noise: the oracle's score rounding, and a
    #: subspace unit's basis term, sized to the noise measured (:meth:`SubspaceDesign.basis_variance`)
    variance: np.ndarray
    #: (G, H) the consensus label's error with the samples' errors scaled as in ``variance`` (final
    #: stage; NaN otherwise)
    label_error: np.ndarray
    finals: np.ndarray | None = None  # (G, H, d, d) the final tokens, kept only when small (KEEP_BYTES)
    #: (G, H, d, H + 1) each token's coordinates in the orthonormal basis :func:`span_basis` of its unit's
    #: ``estimates`` and mean token (``mean_token``, (G, H, d)), and (G, H, d) its norm off that span: kept
    #: when the tokens are not (SPAN_BYTES)
    span_coords: np.ndarray | None = None
    off_span: np.ndarray | None = None
    mean_token: np.ndarray | None = None

    @property
    def error_squared(self) -> np.ndarray:
        """(G, H, 2) ``|X^{-1} diag(sigma)|_F^2``: :attr:`variance` summed over the coordinates."""
        return self.variance.sum(axis=2)

    def consensus_labels(self, sigma_scale=1.0) -> tuple[np.ndarray, np.ndarray]:
        """Inverse-variance mean of the labels of each (group, head) over its instances, and its
        error; ``sigma_scale`` (broadcast to (G, H, rounds)) scales the instances' label errors."""
        weights = np.where(np.isfinite(self.label), 1.0 / np.maximum(sigma_scale * self.sigma_l, 1e-300) ** 2, 0.0)
        total = np.maximum(weights.sum(axis=2), 1e-300)
        return (np.nan_to_num(self.label) * weights).sum(axis=2) / total, 1.0 / np.sqrt(total)

    def refit_with_consensus_labels(self) -> None:
        """Final groups: each instance's ``m`` again, now with its label fixed at the consensus."""
        labels, _ = self.consensus_labels()
        G, H, rounds, K = self.gaps.shape
        m, sigma, spread = single_pole.log_pole_given_label(
            self.gaps.reshape(-1, K), self.ks.reshape(-1, K), self.rounding.reshape(-1, K),
            np.repeat(labels.ravel(), rounds), misfit=True)
        self.log_pole = m.reshape(G, H, rounds)
        self.sigma_m = sigma.reshape(G, H, rounds)
        # no third sample: the two samples' disagreement given the label is the test
        two = (np.isfinite(self.gaps).sum(axis=3) == 2)
        self.residual = np.where(two, spread.reshape(G, H, rounds), self.residual)

    def solve(self) -> np.ndarray:
        """``a_h`` of every group and head from ``a_h^T x_n = m_n`` (G, H, d)."""
        return self.a

    @classmethod
    def concatenate(cls, parts: list["GroupMeasurements"], estimates) -> "GroupMeasurements":
        """The parts of one stage as one, with its ``estimates`` (the stage's own source: the
        parts' slices of it are not kept)."""
        def joined(name):
            arrays = [getattr(part, name) for part in parts]
            return None if any(array is None for array in arrays) else np.concatenate(arrays)
        return cls(**{f.name: estimates if f.name == "estimates" else joined(f.name)
                      for f in fields(cls) if f.name != "finals"})


def measure_units(prober: Prober, differences: np.ndarray, estimates, rng, bridge: bool,
             W_score: np.ndarray | None = None, copies=None, bases: np.ndarray | None = None,
             designer=None, block: int = CORRECTION_BLOCK, basis_error=None) -> GroupMeasurements:
    """Targeted instances for every unit ``(g, h)``: head h with difference ``differences[g, h]``.

    ``differences`` (G, H, d); ``estimates`` (G, H, H, d), an array, a broadcast view or
    :class:`HeadsAt` read a chunk of groups at a time: for unit ``(g, h)`` the ``a_f`` of all
    heads f at its difference, used for the design. The target's own row is corrected after every
    block of rounds to fit its measured log-poles (:func:`correction_blocks`; not at all while the
    prior aims within ``AIM_TOLERANCE``, for bridges ``BRIDGE_AIM_TOLERANCE``). ``copies``: the copy
    counts of round 0 and of the later rounds; by default final units ask ``k = 1, 2, 3`` every round,
    bridges ``k = 1, 2`` in round 0 and ``k = 1`` later (the label is then known); a designer may
    choose them per round (``designer.copies``: :class:`FinalDesign`). ``W_score`` (final stage):
    the model used for the oracle's score rounding in the error estimate. ``bases`` (G, H, d, r):
    measure each unit in the subspace of its head (r rounds, :class:`SubspaceDesign`) instead of R^d (d rounds),
    ``basis_error`` what those bases got wrong (:meth:`SubspaceDesign.basis_variance`; final stage).
    ``designer``: another design class with the interface of :class:`FullDesign` (the lifted
    design of the biased model, :mod:`.biased`, whose units have ``d + 1`` rounds). ``block``: the
    most rounds designed from one corrected estimate, and the first block (:func:`correction_blocks`;
    1 for the first group, whose prior from phase 1 can miss its aim by 10 log-pole units on float32
    answers: its first round shows whether it does).

    Units are independent: they are measured in chunks of groups whose working arrays (final
    tokens, null parts, Gram-Schmidt bases: three (units, d, d) arrays) fit ``CHUNK_BYTES``, so
    memory does not grow with all instances x d.
    """
    G, H, _, d = estimates.shape
    if copies is None:
        copies = ((1, 2), (1,)) if bridge else (FINAL_COPIES, FINAL_COPIES)
    designer = designer or (FullDesign if bases is None else SubspaceDesign)
    rounds = d if bases is None else bases.shape[3]
    per_chunk = max(1, CHUNK_BYTES // (24 * d * d * H))
    keep = G * H * rounds * d * 8 <= KEEP_BYTES
    span = not keep and G * H * rounds * (H + 1) * 8 <= SPAN_BYTES
    # The first (largest) chunk's patterns and final tokens are reused by the later chunks: a large
    # array made afresh per chunk is mapped and zeroed by the kernel each time (docs/algorithm.md, 'Fresh memory is not
    # free'), and the tokens of a stage too large to keep are never all held at once.
    parts, pattern_buffer, finals_buffer, basis_buffer = [], None, None, None
    for start in range(0, G, per_chunk):
        stop = min(G, start + per_chunk)
        patterns = designer.patterns(rng, d, H, rounds, stop - start,
                                     out=None if pattern_buffer is None else pattern_buffer[:stop - start])
        pattern_buffer = patterns if pattern_buffer is None else pattern_buffer
        current = estimates[start:stop].reshape(-1, H, d).copy()
        heads = np.tile(np.arange(H), stop - start)
        design = (designer(current, heads, patterns.reshape((-1,) + patterns.shape[2:])) if bases is None else
                  designer(current, heads, patterns.reshape((-1,) + patterns.shape[2:]),
                           bases[start:stop].reshape(-1, d, rounds)))
        design.basis_error = basis_error
        if basis_buffer is not None:
            design.correction.spare = basis_buffer[:len(heads)]
        if bridge:
            design.correction.tolerance = BRIDGE_AIM_TOLERANCE
        if prober.unit > EPS and hasattr(design, "for_noisy_answers"):
            design.for_noisy_answers()
        part = _measure_chunk(prober, differences[start:stop], estimates[start:stop], design, copies,
                              not bridge, W_score, f"{'bridge' if bridge else 'final'} instances, groups "
                              f"{start + 1}..{stop} of {G}", block,
                              None if finals_buffer is None else finals_buffer[:(stop - start) * H], span=span)
        if not keep:
            finals_buffer = part.finals.reshape(-1, rounds, d) if finals_buffer is None else finals_buffer
            part.finals = None
        if basis_buffer is None:
            basis_buffer = design.correction.basis
        part.estimates = None  # the chunk's slice: read again from the source when needed
        parts.append(part)
    out = GroupMeasurements.concatenate(parts, estimates)
    if keep:
        out.finals = np.concatenate([part.finals for part in parts])
    return out


def _measure_chunk(prober, differences, estimates, design, copies, refit, W_score, description,
                   block: int = CORRECTION_BLOCK, finals: np.ndarray | None = None, span: bool = False
                   ) -> GroupMeasurements:
    """:func:`measure_units` on one chunk of groups, all its units batched as arrays in every round
    (``finals``: an array (units, rounds, d) to write the final tokens into, else a new one; ``span``:
    keep the tokens' :func:`span_coordinates`)."""
    G, H, _, d = estimates.shape
    U, rounds = G * H, design.rounds
    diffs = differences.reshape(U, d)
    K = len(copies[0])
    finals = np.empty((U, rounds, d)) if finals is None else finals
    log_pole, label, designed, residual = (np.full((U, rounds), np.nan) for _ in range(4))
    sigma_m, sigma_l = np.full((U, rounds), np.inf), np.full((U, rounds), np.inf)
    K = max(K, max(len(design.copies(n, copies)) for n in range(rounds)))
    gaps_all, rounding_all, ks_all = (np.full((U, rounds, K), np.nan) for _ in range(3))

    correcting = lambda: design.correction.added > 0  # noqa: E731
    for rounds_block in correction_blocks(rounds, block, correcting):  # a block's rounds: designed from one estimate
        tokens = design.design(rounds_block, finals[:, rounds_block])  # written in place, then rounded there
        prober.quantize(tokens, out=tokens)
        block_copies = [design.copies(n, copies) for n in range(rounds_block.start, rounds_block.stop)]
        # the block's rounds asked at once (their designs do not depend on each other's answers)
        samples = prober.rounds_gaps(finals[:, rounds_block], diffs, block_copies,
                                     f"{description}, rounds {rounds_block.start + 1}..{rounds_block.stop}/{rounds}")
        for n, ks, (gaps, rounding) in zip(range(rounds_block.start, rounds_block.stop), block_copies, samples):
            gaps_all[:, n, :len(ks)], rounding_all[:, n, :len(ks)], ks_all[:, n, :len(ks)] = gaps, rounding, ks
        # the rounds fitted with the same copy counts in one batched fit (each row's fit is its own:
        # the same numbers as round by round), before the one-sample readings, which read round 0's label
        for ks in dict.fromkeys(ks for ks in block_copies if len(ks) > 1):
            fitted = [n for n, each in zip(range(rounds_block.start, rounds_block.stop), block_copies) if each == ks]
            count = len(ks)
            fits = single_pole.fit(gaps_all[:, fitted, :count].transpose(1, 0, 2).reshape(-1, count), ks,
                                   rounding_all[:, fitted, :count].transpose(1, 0, 2).reshape(-1, count))
            per_round = lambda values: values.reshape(len(fitted), U).T  # noqa: E731
            log_pole[:, fitted], label[:, fitted] = per_round(fits.log_pole), per_round(fits.label)
            sigma_m[:, fitted], sigma_l[:, fitted] = per_round(fits.sigma_m), per_round(fits.sigma_l)
            residual[:, fitted] = per_round(fits.residual) if count > 2 else np.nan
        for n, ks in zip(range(rounds_block.start, rounds_block.stop), block_copies):
            if len(ks) > 1:
                continue
            gap, rounding, k = gaps_all[:, n, 0], rounding_all[:, n, 0], ks[0]
            m = single_pole.reading(gap, 0.0, label[:, 0], k)
            log_pole[:, n] = m
            # One sample: the error of m from the rounding of G(k) (dm = dG (k + tau)^2 / (l k tau)).
            tau = np.exp(m)
            sigma_m[:, n] = rounding * (k + tau) ** 2 / np.abs(label[:, 0] * k * tau)
        designed[:, rounds_block] = design.update(rounds_block, finals[:, rounds_block], log_pole[:, rounds_block])
    shape = lambda array: array.reshape((G, H) + array.shape[1:])  # noqa: E731
    out = GroupMeasurements(differences, estimates, *(shape(a) for a in (
        log_pole, label, designed, residual, sigma_m, sigma_l, gaps_all, rounding_all, ks_all)),
        np.full((G, H, d), np.nan), *(np.full((G, H, rounds), np.nan) for _ in range(3)),
        np.full((G, H, d, 2), np.nan), np.full((G, H), np.nan))
    if refit:
        out.refit_with_consensus_labels()
    _reduce_chunk(out, finals, design, W_score, prober.unit, prober.score_unit, prober.systematic)
    if span:
        mean = finals.mean(axis=1)
        coords, off = span_coordinates(finals, span_basis(out.estimates.reshape(U, H, d), mean))
        out.span_coords, out.off_span = coords.reshape(G, H, rounds, H + 1), off.reshape(G, H, rounds)
        out.mean_token = mean.reshape(G, H, d)
    out.finals = finals.reshape(G, H, rounds, d)
    return out


def _reduce_chunk(out: GroupMeasurements, finals: np.ndarray, design, W_score, unit: float = EPS,
                  score_unit: float = EPS, systematic=None) -> None:
    """What the rest of the run needs of a chunk's final tokens (U, rounds, d), before they are
    dropped: the solved ``a``, each instance's misfit, margin and norm, and the error-estimate terms
    (the samples' rounding at the answers' ``unit``, the scores' at the oracle's ``score_unit``;
    ``systematic``: the prober's rounding common to an instance's samples, :meth:`Prober.systematic`)."""
    G, H, rounds = out.log_pole.shape
    U, d, heads = G * H, finals.shape[2], design.heads
    if not np.array_equal(heads, np.tile(np.arange(H), G)):  # the (group, head) order read below
        raise AssertionError("a chunk's units must be ordered by group, then head")
    m = out.log_pole.reshape(U, rounds)
    sigma, score_sigma = np.full((U, rounds), np.nan), np.full((U, rounds), np.nan)
    x_norm = np.sqrt(np.einsum("und,und->un", finals, finals))  # (no (U, rounds, d) temporary)
    if W_score is not None:
        # The oracle's rounding of the log-pole y^T q - x^T q = -z^T q, q = W_h x: the two dot
        # products round at eps |x| |q| (|x| <= 0.1 |z| over the targeted runs measured), q's own
        # rounding enters as z^T dq, about eps |z| times :func:`_score_norms`.
        z_norm = np.linalg.norm(out.differences.reshape(U, d), axis=1)
        score_factor, sample_scale = (NOISY_SCORE_FACTOR if score_unit > EPS else SCORE_FACTOR), 1.0
        common = np.zeros((U, rounds))  # the largest share of a sample's rounding common to its instance's
        if unit > EPS:
            # noisy answers (docs/algorithm.md, 'Low-precision oracles: float32, mixed precision, bfloat16'): typical
            # errors rather than float64's bounds
            # The samples' rounding model (4 units per magnitude) against what the three-sample fits
            # show: with one degree of freedom each, E[residual^2] = (actual / modelled error)^2.
            residual = out.residual[np.isfinite(out.residual)]
            if residual.size:
                sample_scale = float(np.clip(3.0 * np.sqrt(np.mean(residual**2)), NOISY_SAMPLE_FLOOR, 1.0))
            if systematic is not None:
                shared = systematic(finals.reshape(U * rounds, -1)).reshape(U, rounds)
                with np.errstate(invalid="ignore", divide="ignore"):
                    ratio = np.nan_to_num(shared[:, :, None] / out.rounding.reshape(U, rounds, -1))
                common = np.clip(ratio.max(axis=2), 0.0, 1.0)
        score_norms = _score_norms(finals.reshape(G, H, rounds, d), W_score, x_norm.reshape(G, H, rounds))
        score = score_factor * score_unit * z_norm[:, None] * score_norms.reshape(U, rounds)
        # the residuals scale the samples' own errors, not the part common to an instance's
        # samples (the anchor's: docs/algorithm.md, 'Low-precision oracles: float32, mixed precision, bfloat16'; scaled
        # too, the estimate would understate the truth)
        scaled = sample_scale * (1.0 - common) + common
        samples = scaled * out.sigma_m.reshape(U, rounds)
        sigma, score_sigma = np.hypot(samples, score), score
        # the labels' consensus error with the same scaling (unscaled, the v part would overstate
        # the error)
        out.label_error = out.consensus_labels(scaled.reshape(G, H, rounds))[1]
    ok = np.isfinite(m).all(axis=1)
    variances = None
    if W_score is not None:
        # First order, independent errors: |a_i error| ~ sqrt(sum_n (X^{-1})_{in}^2 sigma_n^2), the map
        # applied to diag(sigma). Applied to sigma itself the errors would cancel in the sum and
        # the estimate understate the truth. Both parts
        # at once (a huge sigma squared to inf is held at the largest float, so that 0 x it stays 0).
        with np.errstate(over="ignore", invalid="ignore"):
            variances = np.stack([np.nan_to_num(sigma), np.nan_to_num(score_sigma)], axis=2) ** 2
        variances = np.minimum(variances, np.finfo(np.float64).max)
    solution, spread_squared = _solve_units(finals, design, np.nan_to_num(m), variances, x_norm)
    if spread_squared is not None:
        from_basis = design.basis_variance(finals, solution)
        if from_basis is not None:  # sized to the noise the full units showed: in both parts
            spread_squared += from_basis[:, :, None]
    a = np.where(ok[:, None], solution, np.nan)
    out.a = a.reshape(G, H, d)
    out.misfit = np.abs(m - np.matmul(finals, a[:, :, None])[:, :, 0]).reshape(G, H, rounds)
    poles = np.matmul(finals, out.estimates.reshape(U, H, d).transpose(0, 2, 1))  # (U, rounds, H)
    poles[np.arange(U), :, heads] = np.inf
    out.margin = poles.min(axis=2).reshape(G, H, rounds) if H > 1 else np.full((G, H, rounds), np.inf)
    out.x_norm = x_norm.reshape(G, H, rounds)
    if W_score is not None:  # an unbounded spread is an infinite estimate, said so
        out.variance = np.where(ok[:, None, None], spread_squared, np.nan).reshape(G, H, d, 2)


def span_basis(estimates: np.ndarray, mean_tokens: np.ndarray) -> np.ndarray:
    """An orthonormal basis (..., D, H + 1) of the span of each unit's design estimates, the rows
    ``a_f(z)`` of ``estimates`` (..., H, D), and of its mean token (..., D): the part of its tokens
    common to every round, the lifted coordinate's 1 or a null-space slot held constant by the
    pattern (Householder QR: orthonormal to rounding whatever the rows' conditioning). The same
    estimates and mean give the same basis, so :func:`instance_diagnostics` rebuilds it from the
    stage's ``estimates`` and ``mean_token`` instead of keeping it."""
    rows = np.concatenate([estimates, mean_tokens[..., None, :]], axis=-2)
    return np.linalg.qr(np.swapaxes(rows, -1, -2))[0]


def span_coordinates(finals: np.ndarray, basis: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Each token's coordinates ``c_n = Q^T x_n`` in its unit's ``basis`` Q (U, D, k) and its norm off
    that span, ``|x_n - Q c_n|``, for the tokens ``finals`` (U, rounds, D): all that is needed to bound
    any ``a^T x_n`` once ``a`` is known, ``a^T x_n = (Q^T a)^T c_n + (a - Q Q^T a)^T (x_n - Q c_n)``
    (docs/algorithm.md, 'The targeted schedule', 'Margins without the tokens'). The residuals are formed in blocks of units
    (``INVERSE_BLOCK_BYTES``): no second array of the tokens' size."""
    U, rounds, D = finals.shape
    coords = np.matmul(finals, basis)
    off = np.empty((U, rounds))
    step = max(1, INVERSE_BLOCK_BYTES // (8 * rounds * D))
    for start in range(0, U, step):
        units = slice(start, start + step)
        rest = finals[units] - np.matmul(coords[units], np.swapaxes(basis[units], 1, 2))
        off[units] = np.sqrt(np.einsum("und,und->un", rest, rest))
    return coords, off


#: The floor of :func:`_score_norms` as a fraction of ``|W_h|_F |x| / sqrt(d)``, the expected size of
#: ``|W_h x|`` for a token in no particular direction: ordinary tokens stay above it (their estimates
#: unchanged), tokens nearly in a head's null space are lifted to it. (At the full expected size
#: ordinary runs' estimates would grow, and float32 layers' pass their error_estimate limit.)
SCORE_NORM_FLOOR = 0.5


def _score_norms(by_head: np.ndarray, W_score: np.ndarray, token_norms: np.ndarray | None = None) -> np.ndarray:
    """``max(|W_h x|, SCORE_NORM_FLOOR |W_h|_F |x| / sqrt(d))`` (G, H, rounds) of each unit's own head
    h for its tokens ``by_head`` (G, H, rounds, d) (units ordered (group, head): head h's tokens are
    the strided view ``by_head[:, h]``; ``token_norms`` their ``|x|`` (G, H, rounds), if known).

    They size the oracle's score rounding ``8 eps |z| |q|`` in the error estimate, ``q = W_h x`` as
    the oracle forms it: its rounding error is about ``eps |W_h|_F |x| / sqrt(d)`` (each entry a sum
    of d products of random signs), which is what the log-pole ``-z^T q`` carries where x lies nearly
    in W_h's null space (a low-rank head, a token aimed at a small log-pole along it: modelled by ``|W_h x|`` alone the
    rounding, and the estimate, would fall far below the truth). A few digits suffice: the products run
    in float32 (sgemm, twice dgemm's speed; ``d^2`` per token is a large part of the learner), with each head's W scaled to entries at most
    1, to a relative error about ``d 2^-24 cond(W_h)`` (4e-3 at d = 256 for a Gaussian W). A row whose
    float32 norm is not a positive finite number (overflow, underflow) is computed again in float64."""
    G, H, rounds, d = by_head.shape
    if token_norms is None:
        token_norms = np.linalg.norm(by_head, axis=3)
    norms = np.empty((G, H, rounds))
    tokens, product = np.empty((G, rounds, d), np.float32), np.empty((G, rounds, d), np.float32)
    with np.errstate(over="ignore", under="ignore", invalid="ignore"):
        for h in range(H):
            size = float(np.abs(W_score[h]).max())
            size = size if np.isfinite(size) and size > 0 else 1.0
            np.copyto(tokens, by_head[:, h], casting="same_kind")
            np.matmul(tokens, (W_score[h].T / size).astype(np.float32), out=product)
            norms[:, h] = size * np.sqrt(np.einsum("gnd,gnd->gn", product, product).astype(np.float64))
            redo = ~((norms[:, h] > 0) & np.isfinite(norms[:, h]))
            if redo.any():
                exact = np.matmul(by_head[:, h][redo], W_score[h].T)
                norms[:, h][redo] = np.sqrt(np.einsum("nd,nd->n", exact, exact))
            floor = SCORE_NORM_FLOOR * np.linalg.norm(W_score[h]) / np.sqrt(d) * token_norms[:, h]
            np.maximum(norms[:, h], floor, out=norms[:, h])
    return norms


#: An approximate inverse Y is used (:func:`_refined_solve`) only when ``|X Y p - p| <= INVERSE_CHECK |p|`` on a probe
#: p; each refinement step then shrinks the error about that much (the design's Y: ``2^-38 cond(X)``, 1e-8
#: at d = 6 and d = 160), and at most ``REFINEMENT_STEPS`` take ``INVERSE_CHECK`` below float64's rounding.
INVERSE_CHECK, REFINEMENT_STEPS = 1e-4, 3


def _solve_units(finals: np.ndarray, design, rhs: np.ndarray, variances: np.ndarray | None = None,
                 row_norms: np.ndarray | None = None):
    """``a`` (U, D) from ``X a = rhs`` for every unit of a chunk and, given the rounds' ``variances``
    (U, D, V), the first-order spread ``(X^{-1})^2 variances`` (U, D, V) (else None), each by the
    cheapest route the design allows that is as accurate as an LU solve (docs/algorithm.md, 'The inverse from the
    design'): a stage whose corrections fitted every round reads ``a`` off its corrected estimate where the residual
    shows it backward stable, ``|m_n - x_n^T a| <= 64 eps (|x_n| |a| + |m_n|)``; a design never corrected has its
    inverse from its structure, refined (:func:`_refined_solve`), in blocks of units (``INVERSE_BLOCK_BYTES``); LU
    for the rest. ``row_norms``: the ``|x_n|`` (U, D) if known."""
    U, D = rhs.shape
    solution = None if variances is not None else design.fitted_solution()
    if solution is not None:
        with np.errstate(all="ignore"):
            residual = np.abs(rhs - np.matmul(finals, solution[:, :, None])[:, :, 0])
            if row_norms is None:
                row_norms = np.sqrt(np.einsum("und,und->un", finals, finals))
            size = row_norms * np.linalg.norm(solution, axis=1)[:, None] + np.abs(rhs)
        rough = ~(residual <= 64 * EPS * size).all(axis=1)
        if rough.any():
            solution[rough] = design.solve(finals[rough], rhs[rough][:, :, None], rough)[:, :, 0]
        return solution, None
    spread = None  # (U, d) and (U, d, V): a subspace unit's a is in R^d, its rounds r
    step = max(1, INVERSE_BLOCK_BYTES // (8 * D * D))
    for start in range(0, U, step):
        part = slice(start, min(U, start + step))
        refined = _refined_solve(finals[part], design.approximate_inverse(part), rhs[part])
        if refined is None and variances is None:
            solved = design.solve(finals[part], rhs[part, :, None], part)
            refined = solved[:, :, 0], None
        elif refined is None:
            identity = np.broadcast_to(np.eye(D), (part.stop - start, D, D))
            solved = design.solve(finals[part], np.concatenate([rhs[part, :, None], identity], axis=2), part)
            refined = solved[:, :, 0], solved[:, :, 1:]
        if solution is None:
            solution = np.empty((U, refined[0].shape[1]))
            if variances is not None:
                spread = np.empty((U, refined[1].shape[1], variances.shape[2]))
        solution[part], inverse = refined
        if variances is not None:
            with np.errstate(over="ignore", invalid="ignore"):
                spread[part] = np.matmul(np.square(inverse, out=inverse), variances[part])
    return solution, spread


def _refined_solve(finals: np.ndarray, inverse: np.ndarray | None, rhs: np.ndarray):
    """``a`` (U, D) from ``X a = rhs`` with an approximate inverse ``Y`` of every X (U, D, D):
    ``a = Y rhs``, then ``a += Y (rhs - X a)`` (iterative refinement in float64: each step multiplies
    the error by ``I - Y X``, whose size ``mu`` the probe estimates, so ``k`` steps leave
    ``mu^(k + 1)``: as many as take it below ``EPS / 4``; the result is backward stable as an LU
    solve's). Returns ``(a, Y)``, or None (solve by LU instead) when Y is None or fails the probe
    ``mu = max |X Y p - p|_inf / |p|_inf <= INVERSE_CHECK`` for some unit."""
    if inverse is None:
        return None
    D = finals.shape[1]
    probe = np.cos(1.7 * np.arange(D) + 0.3)  # fixed, dense, no exact zeros; the schedule's rng is not touched
    with np.errstate(all="ignore"):
        misfit = np.abs(np.matmul(finals, np.matmul(inverse, probe)[:, :, None])[:, :, 0] - probe).max()
    mu = misfit / np.abs(probe).max()
    if not mu <= INVERSE_CHECK:
        return None
    steps = REFINEMENT_STEPS if mu <= 0 else min(REFINEMENT_STEPS, int(np.ceil(np.log(EPS / 4) / np.log(mu))) - 1)
    a = np.matmul(inverse, rhs[:, :, None])
    for _ in range(max(1, steps)):
        a += np.matmul(inverse, rhs[:, :, None] - np.matmul(finals, a))
    return a[:, :, 0], inverse


def all_heads_at(W: np.ndarray, differences: np.ndarray) -> np.ndarray:
    """``a_f(z) = W_f^T z`` of every head f (W (H, D, D)) at every unit's difference (G, H', D):
    (G, H', H, D), as one BLAS matmul (faster than an einsum)."""
    H, D, _ = W.shape
    rows = differences.reshape(-1, D) @ W.transpose(1, 0, 2).reshape(D, H * D)
    return rows.reshape(differences.shape[:-1] + (H, D))


class HeadsAt:
    """``a_f(z) = W_f^T z`` of every head f (W (H, D, D)) at every unit's difference (G, H', D),
    as :func:`all_heads_at` gives them, but computed for a slice of groups when it is read
    (``heads_at[start:stop]``): all at once they are ``G H' H D`` numbers, H times the model's
    (137 GB at d = 4096, H = 32), while a stage reads them a chunk of groups at a time.

    Examples
    --------
    >>> import numpy as np
    >>> W, z = np.ones((2, 3, 3)), np.ones((4, 2, 3))
    >>> lazy = HeadsAt(W, z)
    >>> lazy.shape, bool(np.array_equal(lazy[1:3], all_heads_at(W, z)[1:3]))
    ((4, 2, 2, 3), True)
    """

    def __init__(self, W: np.ndarray, differences: np.ndarray):
        self.W, self.differences = W, differences

    @property
    def shape(self) -> tuple:
        return self.differences.shape[:-1] + self.W.shape[:1] + self.differences.shape[-1:]

    def __getitem__(self, groups: slice) -> np.ndarray:
        if not isinstance(groups, slice):
            raise TypeError("HeadsAt is read by slices of groups")
        return all_heads_at(self.W, self.differences[groups])


def shared_estimates(differences: np.ndarray, estimates: np.ndarray):
    """Units of groups shared by all heads: differences (G, d) and a's (G, H, d) broadcast per
    unit (read-only views: nothing is copied H times)."""
    G, H, d = estimates.shape
    return (np.broadcast_to(differences[:, None], (G, H, d)),
            np.broadcast_to(estimates[:, None], (G, H, H, d)))
