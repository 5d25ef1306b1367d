"""The heads' output subspaces from saturated two-token queries, and the oblique split
(docs/algorithm.md, 'Whole answers near the vector bound').

A query ``(lam (x + delta), lam x)`` with large ``lam`` makes every head choose one token: the
answer less ``c + lam V_tot x``, divided by ``lam``, is ``R = sum_{h in S} V_h delta``, a subset
sum of the labels ``w_h = V_h delta``. Along the half circle ``x(theta) = rho (cos theta a +
sin theta b)`` head h's choice flips where ``delta^T (lam W_h x + u_h)`` changes sign; bisection
finds each flip, and the jump of R there is ``+-w_h``. Jumps seen on two half circles (a sum of two
heads' labels recurs with probability zero) are the labels, their signs fixed by
``sum_h w_h = V_tot delta``. Random ``x_k`` then give 0/1 patterns ``B`` (rounded from
``[w]^+ R_k``), and for directions ``delta_j = delta + eps zeta_j`` the same patterns (rounded
again, few flip) give ``V_h zeta_j`` for every head at once by least squares: the span of
``V_h zeta_j`` over j is ``col(V_h) = col(O_h)``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ..oracle.answer_stats import FLOAT64_UNIT
from .values import SplitUnavailable, ValueMap

#: Keys are ``SATURATION`` times the token scale: scores about ``SATURATION^2`` (a head's choice is
#: then 0 or 1 to exp(-40) except within ``40 / SATURATION^2`` of its flip).
SATURATION = 1000.0
#: Half circles start with ``4 H + 1`` samples and bisect to this many bits of the half turn.
BISECTION_BITS = 18
#: Half circles tried before the labels are declared not found.
MOST_CIRCLES = 6
#: A half circle asking more than this many times ``(H + 1) BISECTION_BITS`` samples is not H flips:
#: attention layers ask at most 1.5 times that (random layers, d = 6..32; trained GPT-2 and BERT
#: layers: 0.85..1.1); answers that are not subset sums (a LayerNorm before the attention) change at
#: every sample, and the split tried on them gives up after 530 queries at d = 16, H = 2.
MOST_SAMPLES_PER_FLIP = 8
#: The perturbation of the base difference for the further directions.
PERTURBATION = 0.02
#: Directions per round while some head's rank grows with every column; once none does, a round asks
#: only the columns the stop still needs (``rank + 3`` per head).
DIRECTIONS_PER_ROUND = 8
#: The second round asks ``EXACT_DIRECTIONS r + 2`` independent differences: a head's subspace is the
#: span of its columns ``V_h delta_j``, whose noise it takes divided by their smallest singular value
#: (normalised columns): about ``1 - sqrt(1/EXACT_DIRECTIONS)`` for ``EXACT_DIRECTIONS r`` random columns
#: in r dimensions, but only about ``1 / r`` for ``r + 2`` of them (d = 256, H = 8: subspace errors 3e-13
#: with ``r + 2``, 3.5e-14 with ``2r + 2``, 3e-14 with ``3r + 2``).
EXACT_DIRECTIONS = 2
#: Tokens per oracle call of the split's and the scores' queries: a float64 GPT-2-sized torch layer
#: holds about ten times its batch's tokens while it answers (the run's peak at d = 768 was inside its
#: output projection; at d = 4096 one call of the 18,060 pairs of the second round held 10 GB).
ASK_TOKENS = 2 ** 12
#: Where no refinement follows at all (the split's start is the model: GPT-2 small, d = 768), the
#: second round asks ``UNREFINED_DIRECTIONS r + 2`` differences at ``UNREFINED_DIFFERENCE_SCALE``
#: times the token scale: a head's label ``V_h delta`` then stands that much higher above the
#: rounding of the answer it is read from, whose largest part, the final token's own ``lam V_tot x``,
#: stays the same (d = 768, H = 12, float32: subspace error 1.9e-6 with ``2r + 2`` at the token
#: scale, 9.5e-7 at 16 times it, 4.6e-7 with ``4r + 2`` at 16 times it; 4 and 64 times gain no more
#: than 16, docs/algorithm.md, 'What limits the split's values').
UNREFINED_DIRECTIONS, UNREFINED_DIFFERENCE_SCALE = 4, 16.0
#: A difference whose queries do not decode into patterns of rank H asks this many more batches of
#: final tokens (each the size of the first, ``2 H + 6``) before the split is refused.
MOST_FINAL_BATCHES = 6
#: Oracle calls (``ASK_TOKENS / 2`` saturated pairs each) whose tokens are built at once: a round's
#: pairs grow with its differences (the second round at d = 4096, H = 32, r = 128: ``(4r + 2)(2H + 6)``
#: = 35,980 pairs), and their final tokens, differences, keys, queries and sequences, each ``8 d`` bytes a
#: pair in float64, held for a whole round take 14 GB there; one call's worth is 2,048 pairs, about
#: 67 MB an array at d = 4096. Only the answers (``8 d_out`` bytes a pair, 1.2 GB for that round) are
#: kept for the whole round: the one-token answers at its final tokens (:class:`_Referenced`) are
#: asked after all its pairs, as the oracle's calls are ordered whatever the chunks.
SUMS_CHUNK_CALLS = 1


@dataclass
class Split:
    O: list[np.ndarray]          # per head, an orthonormal basis of col(V_h) (d_out x r_h)
    P: list[np.ndarray]          # per head, r_h x d: V_h = O_h P_h
    ranks: list[int]
    conditioning: float          # cond([O_1 .. O_H])
    queries: int
    _inverse: np.ndarray | None = field(default=None, repr=False)  # [O_1 .. O_H]^+, on first use
    _metric: np.ndarray | None = field(default=None, repr=False)   # :meth:`metric`, on first use

    def coordinates(self, outputs: np.ndarray) -> list[np.ndarray]:
        """Each head's r_h coordinates of ``outputs - c`` (n, d_out): ``z_h = [O^+]_h y``."""
        if self._inverse is None:  # once: at d_out = 768 an SVD of [O_1 .. O_H] costs about a second
            self._inverse = np.linalg.pinv(np.concatenate(self.O, axis=1))
        stacked = self._inverse
        z, start = [], 0
        for rank in self.ranks:
            z.append(outputs @ stacked[start:start + rank].T)
            start += rank
        return z

    def metric(self) -> np.ndarray:
        """``O^T O`` with each head's block padded to the widest rank, (H R, H R): the output metric in
        the heads' stacked coordinates (the answers' rounding ``eps`` shows in ``z = O^+ eps`` with
        covariance ``unit^2 (O^T O)^-1``)."""
        if self._metric is None:
            R, heads = max(self.ranks), len(self.ranks)
            padded = np.zeros((self.O[0].shape[0], heads * R))
            for h, basis in enumerate(self.O):
                padded[:, h * R:h * R + basis.shape[1]] = basis
            self._metric = padded.T @ padded
        return self._metric


def _tolerance(unit: float) -> float:
    """Relative size below which two subset sums count as equal (their rounding, with room)."""
    return max(1e-9, 3e3 * unit)


class _Saturated:
    """Asks saturated pairs and returns their subset sums ``R``."""

    def __init__(self, boundary, values: ValueMap, unit: float):
        self.boundary, self.values, self.unit = boundary, values, unit
        self.asked = 0

    def sums(self, finals: np.ndarray, deltas: np.ndarray, description: str) -> np.ndarray:
        """R for final tokens ``finals`` (n, d) and differences ``deltas`` (n, d)."""
        return self.sums_of(len(finals), lambda rows: (finals[rows], deltas[rows]), description)

    def sums_of(self, count: int, pairs, description: str) -> np.ndarray:
        """R (count, d_out) for ``count`` pairs, ``pairs(rows)`` giving the final tokens and differences of
        the rows of a slice: the pairs' tokens are built ``SUMS_CHUNK_CALLS`` oracle calls at a time, and
        only the answers are kept (in place, they become R)."""
        step = ASK_TOKENS // 2
        chunk = step * SUMS_CHUNK_CALLS
        sums = np.empty((count, len(self.values.c)))
        for first in range(0, count, chunk):
            finals, deltas = pairs(slice(first, min(first + chunk, count)))
            keys = exact_tokens(SATURATION * (finals + deltas), self.unit)
            queries = exact_tokens(SATURATION * finals, self.unit)
            for start in range(0, len(keys), step):
                sequences = [np.stack([k, q]) for k, q in zip(keys[start:start + step], queries[start:start + step])]
                sums[first + start:first + start + len(sequences)] = self._ask(sequences, description)
        self.asked += count
        chunks = [slice(first, min(first + chunk, count)) for first in range(0, count, chunk)]
        self._reference(exact_tokens(SATURATION * pairs(rows)[0], self.unit) for rows in chunks)
        for rows in chunks:
            sums[rows] -= self._unsaturated(exact_tokens(SATURATION * pairs(rows)[0], self.unit))
            sums[rows] /= SATURATION
        return sums

    def _ask(self, sequences: list, description: str) -> np.ndarray:
        """The whole answers to saturated ``sequences``. Their tokens are ``SATURATION`` times the token
        scale by design: an answer that is not finite there (a layer whose own arithmetic overflows at
        such tokens) is no answer to split, and SplitUnavailable says so (the scalar schedules run)."""
        answers = np.asarray(self.boundary.ask(sequences, description, whole=True, overflow=True))
        if not np.isfinite(answers).all():
            norm = max(float(np.linalg.norm(sequence, axis=1).max()) for sequence in sequences)
            raise SplitUnavailable(
                f"the oracle answered {int((~np.isfinite(answers).all(axis=1)).sum())} of {len(sequences)} "
                f"saturated queries with non-finite numbers (tokens of norm up to {norm:.3g}, {SATURATION:g} times "
                "the token scale): a layer that overflows there cannot be split")
        return answers

    def _reference(self, queries) -> None:
        """Asks what :meth:`_unsaturated` needs at the final tokens ``queries`` (chunks of them), after
        the pairs: nothing here."""

    def _unsaturated(self, queries: np.ndarray) -> np.ndarray:
        """``c + V_tot q`` for each query's final token ``q = lam x``, from the value map."""
        return self.values.c + queries @ self.values.V_total.T


class _Referenced(_Saturated):
    """Saturated sums less the one-token answer at the same final token, ``f((lam x)) = c + lam V_tot x``
    to one answer's rounding, asked once per final token (docs/algorithm.md, 'Whole answers near the
    vector bound', 'The subspaces from saturated queries'). The value map's ``c + lam V_tot x`` carries
    V_tot's error times ``lam |x|``: at a final token it is the same for every difference asked there,
    so it moves every column of a head alike and does not average out over the differences."""

    def __init__(self, saturated: _Saturated):
        super().__init__(saturated.boundary, saturated.values, saturated.unit)
        self.answered: dict[bytes, np.ndarray] = {}

    def _reference(self, queries) -> None:
        missing: dict[bytes, np.ndarray] = {}
        for chunk in queries:
            for query in chunk:
                key = query.tobytes()
                if key not in self.answered and key not in missing:
                    missing[key] = query
        if missing:
            answers = self._ask([query[None].copy() for query in missing.values()],
                                "saturated directions: one-token answers at their final tokens")
            self.asked += len(missing)
            self.answered.update(zip(missing, answers))

    def _unsaturated(self, queries: np.ndarray) -> np.ndarray:
        return np.stack([self.answered[query.tobytes()] for query in queries])


def exact_tokens(tokens: np.ndarray, unit: float) -> np.ndarray:
    """Tokens the layer sees exactly: rounded to float32 for answers of float32 precision or coarser
    (its own rounding of the tokens would otherwise move every key), as they are for float64."""
    tokens = np.asarray(tokens, dtype=np.float64)
    return tokens.astype(np.float32).astype(np.float64) if unit >= 2.0 ** -25 else tokens


def _half_circle_jumps(saturated: _Saturated, rng, d: int, scale: float, delta: np.ndarray, heads: int,
                       tolerance: float) -> list[np.ndarray]:
    """The jumps of R along one half circle of final tokens: each head's label, up to sign."""
    a, b = np.linalg.qr(rng.standard_normal((d, 2)))[0].T * scale

    def ask(thetas):
        finals = np.cos(thetas)[:, None] * a + np.sin(thetas)[:, None] * b
        return saturated.sums(finals, np.broadcast_to(delta, finals.shape), "saturated half circles")

    thetas = np.linspace(0.0, np.pi, 4 * heads + 1)
    sums = ask(thetas)
    size = max(float(np.abs(sums).max()), 1e-300)
    smallest = np.pi * 2.0 ** -BISECTION_BITS
    while True:
        if len(thetas) > MOST_SAMPLES_PER_FLIP * (heads + 1) * BISECTION_BITS:
            raise SplitUnavailable("a saturated half circle kept changing between every two samples: its answers "
                                   "are not subset sums (noise above the answers' rounding, or no saturation)")
        differ = np.abs(np.diff(sums, axis=0)).max(axis=1) > tolerance * size
        open_ = differ & (np.diff(thetas) > smallest)
        if not open_.any():
            break
        middles = (thetas[:-1][open_] + thetas[1:][open_]) / 2
        thetas = np.concatenate([thetas, middles])
        sums = np.concatenate([sums, ask(middles)])
        order = np.argsort(thetas)
        thetas, sums = thetas[order], sums[order]
    pieces = np.diff(sums, axis=0)[np.abs(np.diff(sums, axis=0)).max(axis=1) > tolerance * size]
    return _merge_parallel(pieces, tolerance)


def _merge_parallel(pieces: np.ndarray, tolerance: float) -> list[np.ndarray]:
    """Consecutive pieces along one direction are one head passing through its flip (its weight
    between 0 and 1 at the samples inside): summed into one jump."""
    jumps = []
    for piece in pieces:
        if jumps:
            last = jumps[-1]
            cosine = float(last @ piece) / (np.linalg.norm(last) * np.linalg.norm(piece))
            if cosine > 1 - 1e2 * tolerance:
                jumps[-1] = last + piece
                continue
        jumps.append(piece)
    return jumps


def _cluster(jumps: list[tuple[int, np.ndarray]], tolerance: float) -> list[tuple[np.ndarray, set]]:
    """Jumps equal up to sign (within the tolerance), with the half circles that showed each."""
    clusters: list[tuple[np.ndarray, set]] = []
    for circle, jump in jumps:
        norm = np.linalg.norm(jump)
        for index, (vector, circles) in enumerate(clusters):
            sign = 1.0 if vector @ jump >= 0 else -1.0
            if np.linalg.norm(vector - sign * jump) <= 1e2 * tolerance * max(norm, np.linalg.norm(vector)):
                circles.add(circle)
                break
        else:
            clusters.append((jump, {circle}))
    return clusters


def base_labels(saturated: _Saturated, rng, d: int, scale: float, heads: int, values: ValueMap,
                tolerance: float) -> tuple[np.ndarray, np.ndarray]:
    """``(delta, w)``: a base difference and its H labels ``w_h = V_h delta`` (d_out x H)."""
    delta = exact_tokens(rng.standard_normal(d) * scale / np.sqrt(d), saturated.unit)
    target = values.V_total @ delta
    jumps = []
    for circle in range(MOST_CIRCLES):
        jumps += [(circle, jump) for jump in _half_circle_jumps(saturated, rng, d, scale, delta, heads, tolerance)]
        recurring = [vector for vector, circles in _cluster(jumps, tolerance) if len(circles) >= 2]
        if len(recurring) == heads:
            labels = np.stack(recurring, axis=1)
            signs = np.linalg.lstsq(labels, target, rcond=None)[0]
            # each label's coefficient is +-1 to the answers' precision (the sums' own check below):
            # float32 answers at d = 4096, H = 32 leave one of 32 at 1.3e-2, the others near 7e-4
            if (np.abs(np.abs(signs) - 1) < max(1e-3, 1e2 * tolerance)).all():
                labels = labels * np.sign(signs)
                if np.linalg.norm(labels.sum(axis=1) - target) <= 1e2 * tolerance * np.linalg.norm(target):
                    return delta, labels
    raise SplitUnavailable(
        f"saturated half circles did not show {heads} separate heads whose labels sum to V_tot delta "
        f"({len(_cluster(jumps, tolerance))} distinct jumps over {MOST_CIRCLES} half circles): merged or near-equal "
        "heads, heads whose output subspaces overlap (H r > d_out), or a layer that cannot be saturated")


def _patterns(labels: np.ndarray, sums: np.ndarray, tolerance: float) -> tuple[np.ndarray, np.ndarray]:
    """0/1 patterns (n, H) rounded from ``[w]^+ R``, and which queries decoded cleanly."""
    coefficients = np.linalg.lstsq(labels, sums.T, rcond=None)[0].T
    patterns = np.rint(coefficients)
    clean = (np.abs(coefficients - patterns).max(axis=1) < 0.25) & ((patterns == 0) | (patterns == 1)).all(axis=1)
    return patterns, clean


def _fit_labels(patterns: np.ndarray, keep: np.ndarray, sums: np.ndarray, heads: int, tolerance: float) -> np.ndarray:
    """Labels (d_out x H) by least squares on the cleanly decoded queries; a query that misfits (a head
    not quite saturated there) is dropped, the worst first, while H + 2 remain."""
    keep = keep.copy()
    size = float(np.abs(sums).max())
    while keep.sum() >= heads + 2 and np.linalg.matrix_rank(patterns[keep]) == heads:
        labels = np.linalg.lstsq(patterns[keep], sums[keep], rcond=None)[0]
        misfit = np.abs(patterns @ labels - sums).max(axis=1)
        misfit[~keep] = 0.0
        if misfit.max() <= tolerance * size:
            return labels.T
        keep[np.argmax(misfit)] = False
    raise SplitUnavailable("the saturated answers do not decode into 0/1 head choices of rank H (two heads chose "
                           "alike at every final token, or too few clean queries)")


def _decode(sums: np.ndarray, guess: np.ndarray, heads: int, tolerance: float, prior=None) -> np.ndarray:
    """The labels of one difference from its subset sums ``sums`` (n, d_out): the patterns rounded from
    ``guess``'s coefficients. ``prior``: ``(patterns, clean)`` of the base difference at the first
    final tokens, which a perturbed difference shares but where a few heads flip: where the guess
    does not round (a head whose label moved by a good part of itself, ``|V_h delta|`` small beside
    ``PERTURBATION |V_h zeta|``), the labels are fitted to the prior patterns (the flipped queries
    misfit by a whole label and are dropped) and every query is rounded again from that fit."""
    try:
        return _fit_labels(*_patterns(guess, sums, tolerance), sums, heads, tolerance)
    except SplitUnavailable:
        if prior is None:
            raise
    patterns, clean = prior
    start = _fit_labels(patterns, clean, sums[:len(patterns)], heads, tolerance)
    return _fit_labels(*_patterns(start, sums, tolerance), sums, heads, tolerance)


def _labels_of(saturated: _Saturated, finals: np.ndarray, sums: np.ndarray, delta: np.ndarray, guess: np.ndarray,
               heads: int, tolerance: float, draw, prior=None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(labels, finals, sums)`` of one difference, more final tokens asked (batches of ``draw``) while
    its queries do not decode: two heads whose choices agree on every final token so far (trained heads
    alike at this difference: their scores' signs ``delta^T W_h x`` agree on 60..90% of random x) are
    told apart by more of them."""
    batch = len(finals)
    for _ in range(MOST_FINAL_BATCHES):
        try:
            return _decode(sums, guess, heads, tolerance, prior), finals, sums
        except SplitUnavailable:
            extra = draw(batch)
            finals = np.concatenate([finals, extra])
            sums = np.concatenate([sums, saturated.sums(extra, np.broadcast_to(delta, extra.shape),
                                                        "saturated directions: more final tokens")])
    return _decode(sums, guess, heads, tolerance, prior), finals, sums


def output_subspaces(saturated: _Saturated, rng, d: int, d_out: int, scale: float, heads: int,
                     values: ValueMap, unit: float, refinement=lambda ranks: "scores", more_values=None) -> Split:
    """The split of the module docstring, or SplitUnavailable saying why it cannot work. Two rounds:
    perturbed directions (labels decoded from the base's) give the subspaces to about
    ``unit / PERTURBATION`` times their conditioning; independent directions, their labels
    decoded from the first split's prediction ``Pi_h V_tot delta``, give them to the answers'
    rounding. ``refinement(ranks)`` (the heads' ranks from the first round) says what fits the
    model after the split: ``"full"`` (every parameter on every answer, the values too) asks ``r + 2``
    of them, their sums against the value map; ``"scores"`` (the split's values are the model's)
    ``EXACT_DIRECTIONS r + 2``, their sums taken against the one-token answers at the same final tokens
    (:class:`_Referenced`); ``""`` (no refinement: the split's start is the model)
    ``UNREFINED_DIRECTIONS r + 2`` at ``UNREFINED_DIFFERENCE_SCALE`` times the token scale, likewise
    referenced, and then ``more_values()`` (where given) sharpens ``values.V_total`` in place before the
    final oblique split (:func:`~mhaextract.split.values.more_bases`)."""
    tolerance = _tolerance(unit)
    random_tokens = lambda count: exact_tokens(rng.standard_normal((count, d)) * scale / np.sqrt(d), unit)  # noqa: E731
    delta, labels = base_labels(saturated, rng, d, scale, heads, values, tolerance)
    finals = random_tokens(2 * heads + 6)
    base = saturated.sums(finals, np.broadcast_to(delta, finals.shape), "saturated patterns")
    labels, finals, base = _labels_of(saturated, finals, base, delta, labels, heads, tolerance, random_tokens)
    prior = _patterns(labels, base, tolerance)
    columns = [[labels[:, h] / np.linalg.norm(labels[:, h])] for h in range(heads)]
    most = min(d, d_out)
    count = DIRECTIONS_PER_ROUND
    while True:
        moved = exact_tokens(delta + PERTURBATION * random_tokens(count), unit)
        for moved_labels in _labels_along(saturated, finals, moved, lambda _: labels, heads, tolerance,
                                          random_tokens, prior):
            for h in range(heads):
                columns[h].append((moved_labels[:, h] - labels[:, h]) / PERTURBATION)
        ranks = _ranks(columns, unit)
        if (all(rank + 2 < len(column) for rank, column in zip(ranks, columns)) or len(columns[0]) > most + 2
                or sum(ranks) > d_out):  # (the last: they cannot be independent, said at once)
            break
        growing = any(rank >= len(columns[0]) for rank in ranks)
        count = DIRECTIONS_PER_ROUND if growing else max(ranks) + 3 - len(columns[0])
    first = _oblique(columns, ranks, values, d_out, unit, saturated.asked)
    route = refinement(ranks)
    directions = {"full": 1, "scores": EXACT_DIRECTIONS}.get(route, UNREFINED_DIRECTIONS)
    deltas = random_tokens(directions * max(ranks) + 2)
    if not route:
        deltas = exact_tokens(UNREFINED_DIFFERENCE_SCALE * deltas, unit)
    finals = random_tokens(2 * heads + 6)
    exact, sums = [[] for _ in range(heads)], saturated if route == "full" else _Referenced(saturated)
    # the first split's prediction Pi_h V_tot delta = (O_h P_h) delta of every difference's labels (n, d_out, H),
    # one head's projector at a time: all H of them (d_out x d each) would hold 4.3 GB at d = 4096, H = 32
    predicted = np.empty((len(deltas), d_out, heads))
    for h, (O, P) in enumerate(zip(first.O, first.P)):
        predicted[:, :, h] = deltas @ (O @ P).T
    for found in _labels_along(sums, finals, deltas, lambda index: predicted[index], heads, tolerance,
                               random_tokens):
        for h in range(heads):
            exact[h].append(found[:, h])
    del predicted  # (540 MB at d = 4096, H = 32) before more bases of V_tot are asked
    if not route and more_values is not None:
        more_values()
    return _oblique(exact, ranks, values, d_out, unit, saturated.asked + (sums.asked if sums is not saturated else 0))


def _labels_along(saturated: _Saturated, finals: np.ndarray, deltas: np.ndarray, guess, heads: int,
                  tolerance: float, draw, prior=None) -> list[np.ndarray]:
    """For each difference in ``deltas``: the labels (d_out x H) from saturated queries at ``finals``
    (and more where they do not decode, :func:`_labels_of`), their 0/1 patterns rounded from
    ``guess(index)`` (labels near the true ones of the difference ``deltas[index]``) or from ``prior``
    (:func:`_decode`)."""
    count = len(finals)

    def pairs(rows: slice):  # the rows of every difference at every final token, difference by difference
        index = np.arange(rows.start, rows.stop)
        return finals[index % count], deltas[index // count]

    sums = saturated.sums_of(len(deltas) * count, pairs, "saturated directions")
    return [_labels_of(saturated, finals, sums[index * count:(index + 1) * count], delta, guess(index), heads,
                       tolerance, draw, prior)[0]
            for index, delta in enumerate(deltas)]


#: A direction of a head's output subspace counts where its singular value (columns normalised) is
#: this many times the columns' noise, ``unit / PERTURBATION`` (the perturbed differences divide the
#: answers' rounding by ``PERTURBATION``): 1e-4 in float32, where trained heads' value maps fall up to
#: 800-fold and a random set of r + 2 columns shows their weakest direction far above that; float64
#: keeps 1e-9.
RANK_NOISE_FACTOR = 30.0


def _ranks(columns: list[list[np.ndarray]], unit: float) -> list[int]:
    """Each head's rank: its directions (columns normalised) above ``RANK_NOISE_FACTOR`` times the
    columns' noise, the larger of ``unit / PERTURBATION`` (1e-9 at least) and the noise the columns
    show themselves: over the heads with more columns than directions, the median of each one's
    largest singular value past its rank (its noise's norm). Decoded labels keep misfits up to the
    tolerance, so at d = 4096, H = 32 in float64 a head's columns carry noise of up to 1e-9 of its
    largest direction, while its weakest direction stands at 1e-3."""
    spectra = []
    for column in columns:
        vectors = np.stack(column, axis=1)
        singular = np.linalg.svd(vectors / np.linalg.norm(vectors, axis=0), compute_uv=False)
        spectra.append(singular / singular[0])
    cut = max(1e-9, RANK_NOISE_FACTOR * unit / PERTURBATION)
    ranks = [int((spectrum > cut).sum()) for spectrum in spectra]
    past = [spectrum[rank] for spectrum, rank in zip(spectra, ranks) if rank < len(spectrum)]
    if past:
        measured = RANK_NOISE_FACTOR * float(np.median(past))
        if measured > cut:
            ranks = [int((spectrum > measured).sum()) for spectrum in spectra]
    return ranks


def _oblique(columns, ranks, values: ValueMap, d_out: int, unit: float, queries: int) -> Split:
    if sum(ranks) > d_out:
        raise SplitUnavailable(f"the heads' output subspaces have dimensions {ranks}, {sum(ranks)} in all, more "
                               f"than d_out = {d_out}: they cannot be independent (H r > d_out)")
    bases = []
    for column, rank in zip(columns, ranks):
        vectors = np.stack(column, axis=1)
        bases.append(np.linalg.svd(vectors / np.linalg.norm(vectors, axis=0), full_matrices=False)[0][:, :rank])
    stacked = np.concatenate(bases, axis=1)
    conditioning = float(np.linalg.cond(stacked))
    if not conditioning < 1.0 / max(unit, FLOAT64_UNIT) ** 0.5:
        raise SplitUnavailable(f"the heads' output subspaces are nearly dependent (condition number "
                               f"{conditioning:.3g} of [O_1 .. O_H]): the split would amplify the answers' rounding")
    P_all = np.linalg.lstsq(stacked, values.V_total, rcond=None)[0]
    misfit = np.linalg.norm(stacked @ P_all - values.V_total) / np.linalg.norm(values.V_total)
    if misfit > max(1e-8, 1e5 * unit):
        raise SplitUnavailable(f"V_tot is not in the span of the heads' output subspaces (misfit {misfit:.2g}): "
                               "a head was missed")
    P, start = [], 0
    for rank in ranks:
        P.append(P_all[start:start + rank])
        start += rank
    return Split(bases, P, ranks, conditioning, queries)
