"""The rotary start from float32 answers on trained statistics (docs/algorithm.md, 'Rotary attention:
positions, grouped heads and sliding windows', 'Matching' and 'Assembly'): the reference final
token, tokens ordered wrongly, and the log-score grids completed with each entry weighed by its
noise. The whole start on a trained layer is tests/test_zoo.py's float32 Llama case."""

import numpy as np
import pytest

from mhaextract.models.rotary import rotation_blocks
from mhaextract.rotary.completion import complete_low_rank, complete_offset_pairs, completion_rank
from mhaextract.rotary.learn import (MISMATCHED_TOKEN, Instances, log_score_weights, mismatched_tokens, reference_final,
                                     score_size)


@pytest.mark.slow
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_weighted_completion_reads_a_trained_spectrum_through_uneven_noise(seed):
    """A rank-8 grid whose singular values fall 30-fold (a trained head's, docs/trained-layers.md),
    each entry with its own noise (1e-6..1e-3 of the grid's largest entry: log-scores of crowded
    or distant poles), 15% missing: weighed by the entries' inverse variances the completion is
    within 3e-4 of the truth everywhere, and at least five times closer than without weights; the
    weighted rank search, its misfits in the entries' standard deviations, finds the width."""
    rng = np.random.default_rng(seed)
    left, right = (np.linalg.qr(rng.normal(size=(size, 8)))[0] for size in (38, 36))
    truth = (left * np.geomspace(30, 1, 8)) @ right.T
    sigma = 10 ** rng.uniform(-6, -3, size=truth.shape) * np.abs(truth).max()
    grid = truth + sigma * rng.standard_normal(truth.shape)
    grid[rng.random(truth.shape) < 0.15] = np.nan
    weighted = complete_low_rank(grid[None], np.array([8]), weights=1 / sigma[None] ** 2)[0]
    plain = complete_low_rank(grid[None], np.array([8]))[0]
    error = {name: np.abs(fit - truth).max() / np.abs(truth).max() for name, fit in [("weighted", weighted),
                                                                                     ("plain", plain)]}
    assert error["weighted"] <= 3e-4
    assert 5 * error["weighted"] <= error["plain"]
    assert completion_rank(grid, noisy=True, weights=1 / sigma ** 2) == 8


@pytest.mark.slow
def test_the_offsets_fitted_together_complete_a_grid_missing_a_third_of_its_entries():
    """Log-score grids of one rotary head at offsets 1 and 2, ``L(delta) = left R^delta right`` (rank 8,
    singular values falling 30-fold, angles 1, 0.1, 0.01, 0.001), each entry with its own noise
    (1e-4..3e-2), 12% of offset 1's entries missing and 35% of offset 2's (a windowed layer's counts
    leave more of its instances unmatched, docs/algorithm.md, 'Both offsets together (noisy grids)'):
    fitted together in the form ``A B``, ``A M B`` both grids are within 1e-3 of their largest entry,
    where offset 2 completed alone is more than ten times further off."""
    rng = np.random.default_rng(0)
    m, n, r = 36, 38, 8
    R = np.zeros((r, r))
    for block, rotation in enumerate(rotation_blocks(np.array([1.0, 0.1, 0.01, 0.001]))):
        R[2 * block:2 * block + 2, 2 * block:2 * block + 2] = rotation
    left = np.linalg.qr(rng.normal(size=(m, r)))[0] * np.geomspace(30, 1, r)
    right = np.linalg.qr(rng.normal(size=(n, r)))[0].T
    truth = np.stack([left @ R @ right, left @ R @ R @ right])
    truth *= 8 / np.abs(truth).max()
    sigma = 10 ** rng.uniform(-4, -1.5, size=truth.shape)
    grids = truth + sigma * rng.standard_normal(truth.shape)
    grids[0][rng.random((m, n)) < 0.12] = np.nan
    grids[1][rng.random((m, n)) < 0.35] = np.nan
    weights = 1 / sigma[:, None] ** 2
    paired = complete_offset_pairs(grids[:, None], [r], weights)[:, 0]
    alone = complete_low_rank(grids[:, None], np.array([[r], [r]]), weights=weights)[:, 0]
    error = {name: np.abs(fit - truth).max(axis=(1, 2)) / 8 for name, fit in [("paired", paired), ("alone", alone)]}
    assert error["paired"].max() <= 1e-3
    assert error["alone"][1] >= 10 * error["paired"][1]


def test_the_token_scale_counts_only_poles_that_carry_a_head():
    """Self instances' fits (log-poles, labels N / P): a far pole with a label like the others' is a
    large self-score and counts (9.25 with label -0.043, as on llama-d32-h4/0); a far pole whose label
    vanishes beside its instance's others stands for no head (two heads merged into one pole at
    float32 answers, qwen2-d32-h4/1: 14.8 with label 3e-10) and does not."""
    log_P = np.array([[0.658, 1.19, 1.439, 9.254],
                      [-1.103, -0.977, -0.424, 14.781],
                      [0.2, -0.5, 0.9, -1.4]])
    labels = np.array([[-0.0796, -0.0555, 0.0433, -0.0426],
                       [-0.1298, 0.0887, -0.022, 3e-10],
                       [0.05, 0.02, -0.07, 0.01]])
    fitted = Instances(np.exp(log_P), np.exp(log_P) * labels, np.zeros(3))
    counted = np.concatenate([log_P[0], log_P[1, :3], log_P[2]])
    assert score_size(fitted) == pytest.approx(np.sqrt(np.mean(counted ** 2)), rel=1e-12)
    assert score_size(fitted) < 0.6 * np.sqrt(np.mean(log_P ** 2))  # 2.9 counted, 5.1 with the merged heads


def test_the_reference_final_is_the_one_whose_self_poles_lie_furthest_apart():
    tau = np.exp(np.array([[0.1, 0.12, 1.0],     # two poles 0.02 apart: labels split poorly
                           [0.0, 0.5, 1.1],      # closest two 0.5 apart
                           [0.0, 0.8, 1.6],      # 0.8 apart, but its instance failed
                           [0.0, 0.4, 2.0]]))    # 0.4
    usable = np.array([True, True, False, True])
    assert reference_final(tau, usable) == 1
    assert reference_final(tau[:, :1], usable) == 0  # one head: any usable final


def test_a_token_whose_instances_miss_as_a_whole_is_mismatched():
    """Float32 matching misfits spread over decades; a final whose heads were ordered wrongly has
    most of its instances off by about its labels' size, and a key a few misses do not condemn."""
    rng = np.random.default_rng(0)
    worst = 10 ** rng.normal(-2, 0.5, size=(2, 30, 31))
    worst[:, :, 7] = rng.uniform(0.3, 2.0, size=(2, 30))   # a final ordered wrongly
    worst[:, 4, :5] = 1.0                                  # a key with a few poor instances
    worst[0, 9, 3] = np.inf                                # a failed instance
    keys, finals = mismatched_tokens(worst)
    assert np.flatnonzero(finals).tolist() == [7] and not keys.any()
    assert np.median(worst[:, :, 7]) > MISMATCHED_TOKEN * np.median(worst[np.isfinite(worst)])


def test_log_scores_of_crowded_or_small_poles_weigh_less():
    """The weights follow the error of ``log E = log(P - tau - (delta - 1))``: an entry whose pole
    crowds another of its instance's, or whose self pole crowds another, or whose E is small beside
    P, is known less well."""
    tau = np.array([[1.0, 3.0]])                                      # one final, two heads
    log_E = np.log(np.array([[[[2.0]], [[2.0]]], [[[2.0]], [[0.05]]]]))  # (delta, head, key, final)
    offset_P = np.array([[[[3.0, 5.0]]], [[[4.0, 4.05]]]])            # delta = 2: heads' poles crowd
    weights = log_score_weights(log_E, tau, offset_P)[:, :, 0, 0]
    assert weights[1, 0] < weights[0, 0] / 100       # its pole 0.0125 from the other's, against 0.5
    assert weights[1, 1] < weights[1, 0]             # and a small E besides
    crowded = log_score_weights(log_E, np.array([[1.0, 1.01]]), offset_P)[:, :, 0, 0]
    assert crowded[0, 0] < weights[0, 0] / 10        # its self poles 0.01 apart
    alone = log_score_weights(log_E[:, :1], tau[:, :1], offset_P[..., :1])     # one head: no crowding
    assert np.isfinite(alone).all() and (alone > 0).all()


def test_a_failed_float64_run_from_noisy_log_scores_names_them():
    """The answers_residual hint of a float64 run whose instances' log-scores were as noisy as float32's
    (the start's median matching misfit above NOISY_MATCH), naming the key-neutral token's leftover
    key where there is one; nothing for a run that passed, a float32 run, or an exact start."""
    from types import SimpleNamespace

    from mhaextract.rotary.learn import NOISY_MATCH
    from mhaextract.rotary.run import _noisy_float64_start

    def run(**changes):
        fields = dict(coarse=False, diagnostics={"noisy_log_scores": True, "match_quantiles": [5e-5, 1e-2]},
                      residual=1e-3, residual_limit=1e-9, neutral=object())
        return SimpleNamespace(**{**fields, **changes})

    assert 5e-5 > NOISY_MATCH
    said = _noisy_float64_start(run())
    assert "median matching misfit 5e-05" in said and "key-neutral token leaves a key" in said
    assert "key-neutral" not in _noisy_float64_start(run(neutral=None)) != ""
    for quiet in (run(residual=1e-10), run(coarse=True), run(diagnostics={})):
        assert _noisy_float64_start(quiet) == ""


@pytest.mark.parametrize("seed", [0, 1])
def test_a_final_ordered_wrongly_in_one_head_is_left_out_of_the_assembly(seed):
    """A final token whose column of one head's grids carries another head's log-scores (its heads ordered
    wrongly in a few instances, past the matching) misses the assembly ``Z_r^T W X_c`` far beyond the grids'
    noise and is named an outlier (``RotaryLearner._assemble``); assembled without it (the spares keep ``X_c``
    determined) the score matrices are those of the grids' own, and a grid without it names no token."""
    from mhaextract.rotary.learn import RotaryLearner
    d, H, r = 12, 3, 4
    learner = RotaryLearner(d, H, seed, 1.0, True, r, spares=4)
    rng = np.random.default_rng(seed)
    keys, finals = learner.keys, np.vstack([learner.finals, np.ones((1, learner.finals.shape[1]))])
    truth = np.einsum("thar,thbr->thab", rng.normal(size=(2, H, d, r)), rng.normal(size=(2, H, d + 1, r)))
    grids = np.einsum("aj,thab,bi->thji", keys, truth, finals)
    noisy = grids * (1 + 1e-5 * rng.normal(size=grids.shape))
    rows, columns = np.arange(keys.shape[1]), np.arange(finals.shape[1])
    W, _, no_keys, no_finals = learner._assemble(noisy, None, rows, columns, finals, False, {})
    assert no_keys.size == 0 and no_finals.size == 0
    assert np.abs(W - truth).max() <= 1e-2 * np.abs(truth).max()
    wrong = 5
    noisy[:, 0, :, wrong] = noisy[:, 1, :, wrong]     # head 0's column of final 5 from head 1
    W, _, outlier_keys, outlier_finals = learner._assemble(noisy, None, rows, columns, finals, False, {})
    assert outlier_finals.tolist() == [wrong] and outlier_keys.size == 0
    assert np.abs(W - truth).max() >= 10 * np.abs(truth).max() * 1e-2   # spread over the head's matrices
    kept = np.setdiff1d(columns, outlier_finals)
    W, _, outlier_keys, outlier_finals = learner._assemble(noisy, None, rows, kept, finals, False, {})
    assert outlier_keys.size == 0 and outlier_finals.size == 0
    assert np.abs(W - truth).max() <= 1e-2 * np.abs(truth).max()


def test_a_draw_after_one_that_lost_tokens_carries_spares_for_them():
    """``spares_after``: the next draw's spares cover what the last lost (1.5 a token: dropped, mismatched or
    outliers), at least float32's after noisy log-scores, at most d; a draw that lost none keeps its own."""
    from mhaextract.rotary.learn import NOISY_SPARE_TOKENS, SPARE_TOKENS, spares_after
    assert spares_after({}, SPARE_TOKENS, 64) == SPARE_TOKENS
    assert spares_after({"noisy_log_scores": True, "dropped_finals": 3}, SPARE_TOKENS, 8) == NOISY_SPARE_TOKENS
    # mistral-d64-h4/0 in float32: 16 of its finals dropped, 3 keys
    assert spares_after({"noisy_log_scores": True, "dropped_finals": 16, "dropped_keys": 3}, 6, 64) == 24
    assert spares_after({"dropped_finals": 6, "outlier_finals": 1}, 6, 64) == 11
    assert spares_after({"dropped_keys": 60}, 6, 64) == 64
