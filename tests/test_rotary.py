"""Rotary attention (docs/algorithm.md, 'Rotary attention: positions, grouped heads and sliding windows'): the model
against a Llama-style reference written here, the rotation recovered from two score matrices, the window search, and the
rotary schedule end to end against layers whose truth is known."""

import warnings

import numpy as np
import pytest

import mhaextract as mx
from conftest import Float32Answers
from mhaextract.rotary.structure import rotary_head
from mhaextract.rotary.window import find_window
from mhaextract.oracle.boundary import OracleBoundary


def llama_reference(layer: mx.RotaryAttention, X: np.ndarray, start: int = 0) -> float:
    """The final-token output of a scalar rotary layer, computed the way Llama does: absolute
    positions from ``start``, ``rotate_half`` on the pairs (m, m + r/2) after permuting the
    model's consecutive pairs into that layout, softmax over the window."""
    N = len(X)
    H, r, _ = layer.Q.shape
    half = np.concatenate([np.arange(0, r, 2), np.arange(1, r, 2)])  # pair m -> (m, m + r/2)
    out = float(layer.c)
    for h in range(H):
        q = (layer.Q[h] @ X[-1] + layer.b[h])[half]
        k = (X @ layer.K[h].T)[:, half]
        freqs = np.concatenate([layer.theta[h], layer.theta[h]])

        def rope(vector, position):
            rotated = np.concatenate([-vector[..., r // 2:], vector[..., : r // 2]], axis=-1)
            return vector * np.cos(position * freqs) + rotated * np.sin(position * freqs)

        positions = np.arange(start, start + N)
        scores = np.array([rope(k[j], positions[j]) @ rope(q, positions[-1]) for j in range(N)])
        if layer.window is not None:
            scores[: max(0, N - layer.window)] = -np.inf
        weights = np.exp(scores - scores.max())
        weights /= weights.sum()
        out += weights @ (X @ layer.v[h])
    return out


@pytest.mark.parametrize("window", [None, 5])
def test_the_model_is_llamas_rotary_attention_at_any_absolute_offset(window):
    layer = mx.RotaryAttention.random(d=8, heads=4, head_width=6, seed=0, kv_heads=2, bias=True, window=window)
    rng = np.random.default_rng(1)
    for length in (1, 2, 7, 40):
        X = rng.normal(size=(length, 8))
        expected = llama_reference(layer, X, start=int(rng.integers(0, 1000)))
        assert layer(X[None])[0] == pytest.approx(expected, rel=1e-12, abs=1e-12)


def test_score_matrices_are_the_bilinear_scores_and_grouped_heads_share_keys():
    layer = mx.RotaryAttention.random(d=6, heads=4, head_width=4, seed=2, kv_heads=2)
    X = np.random.default_rng(3).normal(size=(9, 6))
    scores = layer.scores(X)
    for delta in (0, 1, 5, 8):
        W = layer.score_matrices(delta)
        assert np.allclose(np.einsum("a,hab,b->h", X[-1 - delta], W, X[-1]), scores[:, -1 - delta], atol=1e-13)
    assert np.array_equal(layer.K[0], layer.K[1]) and not np.array_equal(layer.K[1], layer.K[2])
    assert layer.canonical().heads == 4  # grouped heads have their own queries: nothing merges


@pytest.mark.parametrize("kind", ["rope", "no positions", "partial"])
def test_two_score_matrices_give_the_head_at_every_offset(kind):
    layer = mx.RotaryAttention.random(d=12, heads=2, head_width=8, seed=3)
    if kind == "no positions":
        layer.theta[:] = 0.0
    elif kind == "partial":
        layer.theta[:, 2:] = 0.0
    for h in range(2):
        head = rotary_head(layer.score_matrices(1)[h], layer.score_matrices(2)[h])
        assert head.width == 8
        learned = mx.RotaryAttention(head.Q[None], head.K[None], head.theta[None], np.ones((1, 12)))
        scale = np.abs(layer.score_matrices(1)[h]).max()
        for delta in (0, 1, 2, 7, 100, 255):
            error = np.abs(learned.score_matrices(delta)[0] - layer.score_matrices(delta)[h]).max()
            assert error <= 1e-12 * scale * max(1, delta)
        assert np.allclose(np.sort(head.theta), np.sort(layer.theta[h]), atol=1e-12)


def test_a_width_beyond_the_score_matrix_is_its_full_rank():
    """A grid of more tokens than d whose rank search finds no drop asks for a width above d (the
    augmented W(1) is d x (d + 1)): the head is then of full width, not a broadcasting error."""
    layer = mx.RotaryAttention.random(d=6, heads=1, head_width=6, seed=4, bias=True)
    W1, W2 = layer.score_matrices(1, bias=True)[0], layer.score_matrices(2, bias=True)[0]
    head = rotary_head(W1, W2, width=9)
    assert head.width == 6 and head.K.shape[0] <= 6


@pytest.mark.parametrize("size", [0.05, 0.12, 0.3])
def test_the_scores_are_sized_to_first_order_without_separating_poles(size):
    """score_spread reads the self-scores' root mean square from self instances whose poles are
    too crowded for a rational fit: within a fifth for scores this small, read-out and channels,
    and from the read-out alone (one number a token) within a third over 64 tokens."""
    from mhaextract.rotary.learn import score_spread

    rng = np.random.default_rng(5)
    tokens, H, m = 64, 4, 8
    ks = np.array([0, 1, 2, 3, 5, 9, 17, 29, 51, 90], dtype=float)
    scores = rng.normal(0.0, size, (tokens, H))
    values = rng.standard_normal((tokens, H, m + 1))      # V_h x on the read-out and m channels
    answers = 0.3 + (values[:, None] / (1.0 + ks[None, :, None, None] * np.exp(-scores)[:, None, :, None])).sum(2)
    truth = np.sqrt(np.mean(scores**2))
    both = score_spread(answers[..., 0].ravel(), 0.3, ks, answers[..., 1:].reshape(-1, m), np.full(m, 0.3))
    alone = score_spread(answers[..., 0].ravel(), 0.3, ks)
    assert abs(both / truth - 1) < 0.2 and abs(alone / truth - 1) < 0.35


@pytest.mark.parametrize("coarse", [False, True])
def test_the_token_scale_gives_self_scores_of_the_target_size(coarse):
    """choose_token_scale asks the basis tokens at each scale it tries (the first-order sizing of
    coarse answers, then the rational fits): the self-scores at the scale it settles on have the
    target root mean square, measured here from the layer's own scores."""
    from mhaextract.rotary import learn

    layer = mx.RotaryAttention.random(d=16, heads=2, head_width=8, seed=2)
    layer.Q *= 0.05  # scores of a few hundredths at the first scale, as in a Hugging Face layer
    learner = learn.RotaryLearner(16, 2, 0, 16 ** 0.25, True, None)
    asked = []

    def ask(patterns, description):
        queries = learn.instance_queries(patterns, learner.ks)
        asked.append(np.abs(patterns[0]).max())
        return queries, layer(queries), None

    learn.choose_token_scale(learner, ask, float(layer([np.zeros((1, 16))])[0]), None, coarse)
    self_scores = np.array([layer.scores(x[None])[:, 0] for x in learner.X.T])
    assert len(asked) == 1 + coarse and (not coarse or asked[1] > 2 * asked[0])
    assert abs(np.sqrt(np.mean(self_scores**2)) / learn.SCORE_TARGET - 1) < 0.1


class CountingOracle:
    def __init__(self, model):
        self.model, self.queries, self.longest = model, 0, 0

    def __call__(self, batch):
        self.queries += len(batch)
        self.longest = max([self.longest] + [len(X) for X in batch])
        return self.model(batch)


@pytest.mark.parametrize("window", [8, 16, None])
def test_the_window_is_found_by_queries_of_increasing_length(window):
    layer = mx.RotaryAttention.random(d=6, heads=2, head_width=4, seed=4, bias=True, window=window)
    oracle = CountingOracle(layer)
    boundary = OracleBoundary(oracle, 6)
    c = float(boundary.ask([np.zeros((1, 6))])[0])
    search = find_window(boundary, np.random.default_rng(0), 1.0, c, limit=512)
    assert search.window == window
    assert search.check(6).passed
    assert boundary.queries == oracle.queries == search.queries + 1
    if window is not None:
        assert search.queries <= 2 * np.log2(window) + 2


def fresh_outputs_error(model, layer, longest, count=200, seed=7):
    rng = np.random.default_rng(seed)
    sequences = [rng.normal(size=(int(n), layer.d)) * layer.d ** -0.25 for n in rng.integers(1, longest + 1, count)]
    truth = layer(sequences)
    return float(np.abs(model(sequences) - truth).max() / np.abs(truth).max())


@pytest.mark.parametrize("bias,window", [pytest.param(False, None, marks=pytest.mark.slow), (True, None), (True, 16)])
def test_a_single_rotary_head_is_extracted_to_machine_precision(bias, window):
    layer = mx.RotaryAttention.random(d=8, heads=1, head_width=4, seed=5, bias=bias, window=window)
    oracle = CountingOracle(layer)
    result = mx.extract(oracle, d=8, heads=1, positions="rotary", seed=1)
    assert result.ok and result.window == window
    assert result.queries == oracle.queries and result.max_query_length == oracle.longest
    comparison = mx.compare(result.model, layer)
    assert comparison.max_rel <= 1e-10 and comparison.max_rel <= 10 * result.error_estimate
    assert fresh_outputs_error(result.model, layer, longest=256 if window is None else 4 * window) <= 1e-10
    assert np.allclose(np.sort(result.frequencies[0]), np.sort(layer.theta[0]), atol=1e-8)


@pytest.mark.parametrize("d,heads,width,groups,seed", [(8, 2, 4, 2, 0), pytest.param(8, 2, 4, 1, 1, marks=pytest.mark.slow),
                                                     pytest.param(12, 3, 4, 3, 2, marks=pytest.mark.slow)])
def test_several_heads_are_refined_to_machine_precision(d, heads, width, groups, seed):
    layer = mx.RotaryAttention.random(d=d, heads=heads, head_width=width, seed=seed, kv_heads=groups,
                                      bias=bool(seed % 2))
    oracle = CountingOracle(layer)
    result = mx.extract(oracle, d=d, heads=heads, positions="rotary", seed=seed)
    assert result.ok and result.queries == oracle.queries
    error = mx.compare(result.model, layer).max_rel
    assert error <= 1e-12 and error <= 10 * result.error_estimate
    assert fresh_outputs_error(result.model, layer, longest=256) <= 1e-10
    assert result.refinement.residual_after <= 1e-13


@pytest.mark.slow
def test_a_start_whose_heads_were_matched_wrongly_is_drawn_again(monkeypatch):
    """A draw of instances whose start fails its structure (W(2) outside W(1)'s spaces, or M's
    eigenvalues off the unit circle) is asked again with fresh instances, the better start kept
    and every query counted; a good first draw asks no second."""
    import mhaextract.rotary.learn as learn
    layer = mx.RotaryAttention.random(d=8, heads=1, head_width=4, seed=5, bias=True)
    baseline = mx.extract(CountingOracle(layer), d=8, heads=1, positions="rotary", seed=1)
    assert len(baseline.diagnostics["start_structure_errors"]) == 1
    learned, draws = learn.RotaryLearner.learn, []

    def first_draw_wrong(self, answers, *args, **kwargs):
        start, diagnostics = learned(self, answers, *args, **kwargs)
        draws.append((self.seed, len(answers)))
        if len(draws) == 1:  # as if its heads had been matched wrongly
            diagnostics = dict(diagnostics, subspace_residual=0.9)
        return start, diagnostics

    monkeypatch.setattr(learn.RotaryLearner, "learn", first_draw_wrong)
    oracle = CountingOracle(layer)
    result = mx.extract(oracle, d=8, heads=1, positions="rotary", seed=1)
    assert len(draws) == 2 and draws[0][0] != draws[1][0]
    first, second = result.diagnostics["start_structure_errors"]
    assert first == 0.9 and second <= 1e-6
    assert result.ok and result.queries == oracle.queries == baseline.queries + draws[1][1]
    assert mx.compare(result.model, layer).max_rel <= 1e-10


def test_a_noisy_draw_that_gave_no_start_is_drawn_again_with_more_spare_tokens(monkeypatch):
    """A float64 draw whose log-scores came out noisy (a key-neutral token that leaves a key) and that
    dropped the tokens it mismatched below what the assembly needs gives no start; the next draw
    carries float32's spare tokens (``NOISY_SPARE_TOKENS``), not the same two again."""
    import mhaextract.rotary.learn as learn
    layer = mx.RotaryAttention.random(d=8, heads=1, head_width=4, seed=5, bias=True)
    learned, spares = learn.RotaryLearner.learn, []

    def first_draw_noisy_and_short(self, answers, *args, **kwargs):
        start, diagnostics = learned(self, answers, *args, **kwargs)
        spares.append(self.spares)
        if len(spares) == 1:  # as if three mismatched finals had been dropped from two spares
            kept = {key: value for key, value in diagnostics.items()  # an assembly never reached: no structure
                    if key not in ("subspace_residual", "modulus_error", "widths")}
            return None, dict(kept, noisy_log_scores=True, mismatched_finals=3, dropped_finals=3)
        return start, diagnostics

    monkeypatch.setattr(learn.RotaryLearner, "learn", first_draw_noisy_and_short)
    result = mx.extract(CountingOracle(layer), d=8, heads=1, positions="rotary", seed=1)
    assert spares == [learn.SPARE_TOKENS, learn.NOISY_SPARE_TOKENS]
    assert np.isinf(result.diagnostics["start_structure_errors"][0])
    assert result.ok and mx.compare(result.model, layer).max_rel <= 1e-10


class KeyBiasedRotary:
    """A rotary layer with a key bias (Qwen2-style): a zero token is no longer neutral, so the
    layer is outside the rotary model (docs/algorithm.md, 'Rotary attention: positions, grouped heads and sliding
    windows')."""

    def __init__(self, layer: mx.RotaryAttention, key_bias: np.ndarray):
        self.layer, self.key_bias = layer, key_bias

    def __call__(self, batch):
        out = []
        for X in batch:
            N = len(X)
            total = float(self.layer.c)
            for h in range(self.layer.heads):
                keys = X @ self.layer.K[h].T + self.key_bias[h]
                query = self.layer.Q[h] @ X[-1] + self.layer.b[h]
                scores = []
                for j in range(N):
                    angles = (N - 1 - j) * self.layer.theta[h]
                    q = query.reshape(-1, 2)
                    rotated = np.stack([np.cos(angles) * q[:, 0] - np.sin(angles) * q[:, 1],
                                        np.sin(angles) * q[:, 0] + np.cos(angles) * q[:, 1]], axis=1).ravel()
                    scores.append(keys[j] @ rotated)
                weights = np.exp(np.array(scores) - max(scores))
                total += weights @ (X @ self.layer.v[h]) / weights.sum()
            out.append(total)
        return np.array(out)


@pytest.mark.slow
def test_a_key_bias_outside_the_model_fails_loudly():
    layer = mx.RotaryAttention.random(d=4, heads=1, head_width=2, seed=3, bias=True)
    oracle = KeyBiasedRotary(layer, np.array([[0.8, -0.6]]))
    with pytest.raises(mx.ExtractionError):
        mx.extract(oracle, d=4, heads=1, positions="rotary", seed=0, verify_length=64)


def test_a_window_shorter_than_the_instances_fails_loudly():
    layer = mx.RotaryAttention.random(d=6, heads=2, head_width=4, seed=1, window=4)
    with pytest.raises(mx.ExtractionError, match="window of 4 tokens is shorter"):
        mx.extract(mx.SimulatedOracle(layer), d=6, heads=2, positions="rotary", seed=0)


@pytest.mark.parametrize("options,message", [
    ({"positions": "alibi"}, "positions must be"),
    ({"positions": "rotary", "heads": None, "max_heads": 2}, "does not take max_heads"),
    ({"positions": "rotary", "precision": 32}, "precision must be"),
    ({"positions": "rotary", "schedule": "paper"}, "does not take positions"),
])
def test_bad_rotary_options_are_named(options, message):
    layer = mx.RotaryAttention.random(d=4, heads=1, head_width=2, seed=0)
    arguments = {"heads": 1, **options}
    with pytest.raises(ValueError, match=message):
        mx.extract(mx.SimulatedOracle(layer), d=4, **arguments)


class LlamaStyleOracle:
    """Grouped-query rotary attention written here from its weights, the way Llama computes it
    (``rotate_half`` on the pairs (m, m + r/2), absolute positions 0..N-1, key/value heads
    repeated over their query heads), batched per length: the truth of the acceptance test."""

    def __init__(self, d=32, heads=4, kv_heads=2, head_width=8, base=10000.0, seed=0):
        rng = np.random.default_rng(seed)
        scale = 1.0 / np.sqrt(d * np.sqrt(head_width))
        self.Wq = rng.normal(size=(heads, head_width, d)) * np.sqrt(scale)
        self.Wk = rng.normal(size=(kv_heads, head_width, d)) * np.sqrt(scale)
        self.Wv = rng.normal(size=(kv_heads, head_width, d)) / np.sqrt(d)
        self.Wo = rng.normal(size=(heads, head_width)) / np.sqrt(head_width)  # the read-out of each head
        self.inv_freq = base ** (-np.arange(0, head_width, 2) / head_width)
        self.group = heads // kv_heads

    def rope(self, vectors, positions):
        freqs = np.concatenate([self.inv_freq, self.inv_freq])
        angles = positions[:, None] * freqs
        half = vectors.shape[-1] // 2
        rotated = np.concatenate([-vectors[..., half:], vectors[..., :half]], axis=-1)
        return vectors * np.cos(angles) + rotated * np.sin(angles)

    def __call__(self, batch):
        lengths = np.array([len(X) for X in batch])
        out = np.empty(len(batch))
        for n in np.unique(lengths):
            index = np.flatnonzero(lengths == n)
            X = np.stack([batch[i] for i in index])
            positions = np.arange(n, dtype=np.float64)
            total = np.zeros(len(index))
            for h in range(self.Wq.shape[0]):
                g = h // self.group
                q = self.rope(X[:, -1] @ self.Wq[h].T, positions[-1:])        # (B, r)
                k = self.rope(X @ self.Wk[g].T, positions)                    # (B, n, r)
                scores = np.einsum("bnr,br->bn", k, q)
                weights = np.exp(scores - scores.max(axis=1, keepdims=True))
                weights /= weights.sum(axis=1, keepdims=True)
                values = X @ self.Wv[g].T @ self.Wo[h]                        # (B, n)
                total += (weights * values).sum(axis=1)
            out[index] = total
        return out


@pytest.mark.slow
def test_a_grouped_rotary_layer_written_here_is_extracted_to_1e_10_at_every_length():
    """Issue 40, acceptance 1: d = 32, H = 4, head width 8, two key/value heads, base 10000, no
    biases, float64: outputs on 200 fresh sequences of 1..256 tokens within 1e-10 (the head width
    found by the run, not given)."""
    oracle = LlamaStyleOracle()
    counted = CountingOracle(oracle)
    result = mx.extract(counted, d=32, heads=4, positions="rotary", seed=0)
    assert result.ok and result.queries == counted.queries and result.max_query_length == counted.longest
    assert result.diagnostics["widths"] == [8, 8, 8, 8]
    rng = np.random.default_rng(3)
    sequences = [rng.normal(size=(int(n), 32)) * 32 ** -0.25 for n in rng.integers(1, 257, 200)]
    truth = oracle(sequences)
    assert np.abs(result.model(sequences) - truth).max() / np.abs(truth).max() <= 1e-10
    assert np.allclose(np.sort(result.frequencies, axis=1), np.sort(oracle.inv_freq), rtol=1e-10)


@pytest.mark.slow
def test_a_rotary_result_is_saved_and_loaded_back_exactly(tmp_path):
    layer = mx.RotaryAttention.random(d=6, heads=2, head_width=4, seed=2, bias=True, window=20)
    result = mx.extract(mx.SimulatedOracle(layer), d=6, heads=2, positions="rotary", seed=0)
    json_path, npz_path = mx.save_extraction(result, tmp_path / "rotary.json")
    loaded = mx.load_model(json_path)
    assert isinstance(loaded, mx.RotaryAttention) and loaded.window == 20
    for name in ("Q", "K", "b", "theta", "V"):
        assert np.array_equal(getattr(loaded, name), getattr(result.model, name))
    assert loaded.c == result.model.c and npz_path.exists()
    with pytest.raises(ValueError, match="no exact"):
        mx.load_model(json_path, exact=True)


class WindowedAttention:
    """GPT-2-style attention written here: no positions, query and key biases (the key bias adds
    one score to every key and cancels), value and output biases, and a sliding window of the last
    ``window`` positions."""

    def __init__(self, d, heads, width, window, seed):
        rng = np.random.default_rng(seed)
        self.Wq, self.Wk, self.Wv = (rng.normal(size=(heads, width, d)) / d ** 0.5 for _ in range(3))
        self.bq, self.bk, self.bv = (rng.normal(size=(heads, width)) * 0.3 for _ in range(3))
        self.wo = rng.normal(size=(heads, width)) / width ** 0.5
        self.bo, self.window = 0.2, window

    def __call__(self, batch):
        out = []
        for X in batch:
            keys = X[-self.window:]
            total = self.bo
            for h in range(len(self.Wq)):
                q = self.Wq[h] @ X[-1] + self.bq[h]
                scores = (keys @ self.Wk[h].T + self.bk[h]) @ q / np.sqrt(len(q))
                weights = np.exp(scores - scores.max())
                total += weights @ ((keys @ self.Wv[h].T + self.bv[h]) @ self.wo[h]) / weights.sum()
            out.append(total)
        return np.array(out)


@pytest.mark.parametrize("heads,window", [(1, 8), pytest.param(2, 16, marks=pytest.mark.slow)])
def test_a_windowed_layer_without_positions_is_extracted_with_its_window(heads, window):
    """GPT-2-style windows: no rotation is the rotary model with M = I (docs/algorithm.md, 'Rotary attention: positions,
    grouped heads and sliding windows')."""
    layer = WindowedAttention(d=8, heads=heads, width=4, window=window, seed=heads)
    result = mx.extract(layer, d=8, heads=heads, positions="rotary", rank=4, seed=0)
    assert result.ok and result.window == window
    assert np.abs(result.frequencies).max() <= 1e-8   # nothing rotates
    rng = np.random.default_rng(5)
    sequences = [rng.normal(size=(int(n), 8)) * 8 ** -0.25 for n in rng.integers(1, 4 * window + 1, 200)]
    truth = layer(sequences)
    assert np.abs(result.model(sequences) - truth).max() / np.abs(truth).max() <= 1e-10


def test_the_refinement_reports_its_steps_and_the_run_draws_them_on_its_bar():
    from mhaextract.oracle.progress import RunProgress
    from mhaextract.rotary.refine import refine

    layer = mx.RotaryAttention.random(d=4, heads=1, head_width=2, seed=0)
    rng = np.random.default_rng(0)
    sequences = [rng.normal(size=(int(n), 4)) for n in rng.integers(2, 9, 60)]
    start = mx.RotaryAttention(layer.Q * 1.01, layer.K, layer.theta * 0.99, layer.v)
    steps = []
    refined, report = refine(start, sequences, layer(sequences), on_step=lambda step, misfit: steps.append(misfit))
    assert len(steps) == report.iterations >= 1 and steps[-1] == pytest.approx(report.residual_after)
    with RunProgress() as bar:  # the rotary run draws on a run's bar without error
        result = mx.extract(mx.SimulatedOracle(layer), d=4, heads=1, positions="rotary", seed=0, progress=bar)
    assert result.ok


def test_compare_aligns_rotary_heads_whatever_their_order():
    layer = mx.RotaryAttention.random(d=6, heads=3, head_width=4, seed=4, bias=True)
    order = [2, 0, 1]
    shuffled = mx.RotaryAttention(layer.Q[order], layer.K[order], layer.theta[order], layer.v[order], layer.c,
                                  b=layer.b[order])
    comparison = mx.compare(shuffled, layer)
    assert comparison.max_rel == 0.0
    assert [order[k] for k in comparison.permutation] == [0, 1, 2]  # b's head k is a's permutation[k]


def test_the_completion_finds_the_head_width_through_missing_entries_and_outliers():
    """A rank-8 grid of log-scores with 10% of its entries missing, a fifth off by 1e-6..1e-4 and
    one in a hundred by up to 1e-2 (instances whose poles were fitted poorly or wrongly, as in a
    d = 64 Llama run): the rank is the head width, and the completed grid matches the truth at
    the missing and the outlying entries."""
    from mhaextract.rotary.learn import complete_low_rank, completion_rank
    rng = np.random.default_rng(7)
    truth = rng.normal(size=(40, 8)) @ rng.normal(size=(8, 41))
    grid = truth + 1e-9 * rng.normal(size=truth.shape)
    missing, poor, outlying = (rng.random(truth.shape) < fraction for fraction in (0.1, 0.2, 0.01))
    grid[poor] += 10 ** rng.uniform(-6, -4, poor.sum()) * rng.choice([-1, 1], poor.sum())
    grid[outlying] += rng.uniform(-1e-2, 1e-2, outlying.sum())
    grid[missing] = np.nan
    assert completion_rank(grid) == 8
    completed = complete_low_rank(grid[None], np.array([8]))[0]
    # within a tenth of the poor entries' largest error, on the scale of the grid
    assert np.abs(completed - truth)[missing].max() <= 1e-5 * np.abs(truth).max()
    assert np.abs(completed - truth)[outlying & ~missing].max() <= 1e-5 * np.abs(truth).max()


@pytest.mark.slow
@pytest.mark.parametrize("width", [4, 12])
def test_a_noisy_grid_has_the_rank_of_its_largest_drop(width):
    """Log-scores from float32 answers carry noise (about 1e-3 of their size at d = 64; here 1e-2,
    heavy-tailed, on a smaller grid): the completion's misfit falls from the signal to the noise
    (at d = 64 by 7..30, less than RANK_DROP) and then keeps falling as the fit takes in the noise,
    down to interpolation near the entries' count: the rank is the largest drop's, the head width."""
    from mhaextract.rotary.learn import completion_rank
    rng = np.random.default_rng(width)
    truth = rng.normal(size=(44, width)) @ rng.normal(size=(width, 43)) / np.sqrt(width)
    grid = truth + 1e-2 * rng.standard_t(3, size=truth.shape)
    grid[rng.random(truth.shape) < 0.1] = np.nan
    assert completion_rank(grid, noisy=True) == width
    assert completion_rank(grid) > width  # the float64 criterion stops where the fit interpolates


@pytest.mark.parametrize("seed", range(3))
def test_a_full_width_grid_has_its_rank_where_a_lower_rank_nears_interpolation(seed):
    """A head of full width (r = d = 8) in a grid of d + 2 keys by d + 3 finals, its weakest
    direction 1e-3 of its largest (as in a random two-head layer of head width 8 at d = 8): the
    rank-7 fit has 98 parameters for 110 entries, drops its worst entries and falls a few hundred
    times; the rank-8 fit falls to the rounding. The width is 8, and a grid of rank 7 keeps 7."""
    from mhaextract.rotary.learn import completion_rank
    rng = np.random.default_rng(seed)
    U, V = np.linalg.qr(rng.normal(size=(10, 8)))[0], np.linalg.qr(rng.normal(size=(11, 8)))[0]
    singular = np.array([12, 9.6, 4.3, 3.8, 1.9, 1.3, 0.35, 1e-3])
    noise = 1e-11 * rng.normal(size=(10, 11))
    assert completion_rank((U * singular) @ V.T + noise) == 8
    assert completion_rank((U[:, :7] * singular[:7]) @ V[:, :7].T + noise) == 7


@pytest.mark.slow
def test_a_layer_whose_heads_are_as_wide_as_d_extracts():
    """Two heads of width d (H r > d: the score matrices full rank) from float64 answers: the rank
    search reads the width 8 in both heads, not the 7 at which a fit near interpolation falls first."""
    layer = mx.RotaryAttention.random(d=8, heads=2, head_width=8, seed=0)
    result = mx.extract(layer, d=8, heads=2, positions="rotary", seed=0)
    assert result.ok and result.diagnostics["widths"] == [8, 8]
    assert mx.compare(result.model, layer).max_rel <= 1e-12


@pytest.mark.parametrize("seed", range(3))
def test_a_head_whose_width_no_grid_measured_is_the_widest_that_rotates(seed):
    """``widest_rotary_head``: W(1), W(2) with noise of 1e-6 (float32 log-scores' order): a head as
    wide as d keeps its weakest direction (8.8e-5 of its largest singular value, a gap of 360 below
    the next, which a gap rule of a few hundred would cut), and a head of width 4 at d = 8 drops the
    noise directions beside it (their eigenvalues of M off the unit circle)."""
    from mhaextract.rotary.structure import widest_rotary_head
    rng = np.random.default_rng(seed)
    for width, head in ((8, 1), (4, 0)):
        layer = mx.RotaryAttention.random(d=8, heads=2, head_width=width, seed=0)
        W1, W2 = layer.score_matrices(1)[head], layer.score_matrices(2)[head]
        noise = rng.normal(size=(2, 8, 8)) * 1e-6 * np.abs(W1).max()
        found = widest_rotary_head(W1 + noise[0], W2 + noise[1], 0.1)
        assert found.width == width and found.modulus_error <= 1e-2
        # the weak direction's block is found to within its noise (angles 2e-3 off), the others closer
        assert np.allclose(np.sort(found.theta), np.sort(layer.theta[head]), atol=3e-3 if width == 8 else 1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("shape", [(12, 1, 8, 0), (12, 2, 8, 10), (6, 1, 6, 95)])
def test_a_float32_head_whose_fall_comes_at_the_grids_limit_is_widened(shape):
    """Float32 grids measure widths up to ``measurable_rank`` (7 of an 18 x 17 grid at d = 12): a head of
    width 8 there falls 6.6-fold at 7 (and 1,956-fold at 8, beyond the limit); taken as the width, every
    draw of the start fails its structure. A head whose fall comes at the limit takes the widest width
    above it at which it rotates."""
    d, heads, width, seed = shape
    layer = mx.RotaryAttention.random(d=d, heads=heads, head_width=width, seed=seed, d_out=d)
    result = mx.extract(Float32Answers(layer), d=d, heads=heads, positions="rotary", seed=0, schedule="rotary")
    assert result.ok and result.diagnostics["widths"] == [width] * heads and result.diagnostics["widened_heads"] >= 1
    assert mx.compare(result.model, layer).max_rel <= 1e-6


@pytest.mark.slow
def test_a_float32_layer_whose_head_width_its_grids_cannot_measure_extracts():
    """Float32 answers: a grid of d + 6 keys by d + 7 finals measures widths whose fits leave a third
    of its entries free (at most 7 at d = 12); a head of width 8 there shows no fall, and at the full
    width d it fits noise directions (modulus errors 0.99998 in three draws) and the run fails. The head
    takes the widest width at which it rotates (a head of width 12 at d = 16 likewise: 3.0e-8, measured
    beside it and left out of the suite for its 22 s)."""
    layer = mx.RotaryAttention.random(d=12, heads=1, head_width=8, seed=12, bias=True, window=16, d_out=12)
    result = mx.extract(Float32Answers(layer), d=12, heads=1, positions="rotary", seed=0, schedule="rotary")
    assert result.ok and result.diagnostics["widths"] == [8]
    assert mx.compare(result.model, layer).max_rel <= 1e-6


@pytest.mark.slow
def test_a_float32_start_whose_heads_were_given_different_widths_asks_for_the_width():
    """Two heads of width 14 at d = 16 from float32 answers: the grids give them widths 13 and 14 and the start
    fails loudly; the heads of a layer share one width, so the failure names ``rank=`` first, and with it the
    same layer extracts (``benchmarks/bench_rotary_widths.py``'s first layer)."""
    layer = mx.RotaryAttention.random(d=16, heads=2, head_width=14, seed=83, kv_heads=2, d_out=16)
    with pytest.raises(mx.ExtractionError, match=r"try rank= the heads' width \(config.head_dim; the widths read, "
                                                 r"\[13, 14\], differ") as failure:
        mx.extract(mx.RoundedAnswers(layer, bits=24), d=16, heads=2, positions="rotary", seed=0)
    assert not failure.value.extraction.ok
    result = mx.extract(mx.RoundedAnswers(layer, bits=24), d=16, heads=2, positions="rotary", seed=0, rank=14)
    assert result.ok and mx.compare(result.model, layer).max_rel <= 1e-6


@pytest.mark.slow
def test_a_float64_start_whose_heads_were_matched_wrongly_is_drawn_again():
    """From float64 answers a start's structure error is 1e-10..1e-5 (trained d = 32 layers, random d = 8
    ones); one of 0.03 (heads matched wrongly, two heads as wide as d = 8 under a window of 32) is within the
    float32 limit of 0.1, and the refinement from it ends 6e-3 off. Above ``EXACT_STRUCTURE_LIMIT`` it is drawn
    again."""
    from mhaextract.rotary.learn import EXACT_STRUCTURE_LIMIT
    layer = mx.RotaryAttention.random(d=8, heads=2, head_width=8, seed=61, kv_heads=2, bias=True, window=32, d_out=8)
    result = mx.extract(layer, d=8, heads=2, positions="rotary", seed=0)
    errors = result.diagnostics["start_structure_errors"]
    assert errors[0] > EXACT_STRUCTURE_LIMIT >= errors[-1] and len(errors) >= 2
    assert result.ok and mx.compare(result.model, layer).max_rel <= 1e-12


def test_a_noisy_grid_without_a_drop_keeps_the_full_rank():
    from mhaextract.rotary.learn import completion_rank
    grid = np.random.default_rng(3).normal(size=(30, 31))
    assert completion_rank(grid, noisy=True) == 30


@pytest.mark.slow
def test_a_noisy_head_without_a_clear_fall_takes_the_width_of_the_others():
    """Float32 grids of one layer: a head whose grid is too noisy to show its fall (the full rank
    on its own) takes the width the other heads found, since they share one; a layer where no head
    shows a fall keeps the full rank, and float64 grids are each their own."""
    from mhaextract.rotary.learn import completion_rank, head_widths
    rng = np.random.default_rng(0)
    grids = np.array([rng.normal(size=(24, 4)) @ rng.normal(size=(4, 23)) / 2 + noise * rng.standard_t(3, size=(24, 23))
                      for noise in (1e-3, 1e-3, 0.3)])
    assert completion_rank(grids[2], noisy=True) == 23
    assert head_widths(grids, noisy=True) == ([4, 4, 4], 1)
    assert head_widths(rng.normal(size=(2, 24, 23)), noisy=True) == ([23, 23], 0)
    exact = np.array([rng.normal(size=(24, r)) @ rng.normal(size=(r, 23)) for r in (4, 6)])
    assert head_widths(exact) == ([4, 6], 0)


def test_the_refinement_sums_the_normal_equations_of_the_whole_jacobian(monkeypatch):
    """J^T J and J^T r summed over blocks of a few rows equal those of the whole Jacobian."""
    from mhaextract.rotary import refine
    layer = mx.RotaryAttention.random(d=5, heads=2, head_width=4, seed=3, bias=True)
    rng = np.random.default_rng(0)
    sequences = [rng.normal(size=(int(n), 5)) for n in rng.integers(1, 9, 60)]
    answers = layer(sequences) + 1e-3 * rng.normal(size=60)
    parameters = len(refine.pack(layer))
    whole = refine.length_groups(sequences, parameters)
    monkeypatch.setattr(refine, "BLOCK_ENTRIES", 3 * parameters)
    blocks = refine.length_groups(sequences, parameters)
    assert len(blocks) > len(whole) and max(len(index) for index, _ in blocks) == 3
    rows = np.concatenate([index for index, _ in whole])
    J = np.vstack([refine.jacobian(layer, X)[1] for _, X in whole])[np.argsort(rows)]
    residual, normal, gradient, _ = refine.normal_equations(layer, blocks, answers)
    assert np.allclose(residual, layer(sequences) - answers, rtol=0, atol=1e-12)
    assert np.allclose(normal, J.T @ J, rtol=1e-12, atol=1e-12 * np.abs(normal).max())
    assert np.allclose(gradient, J.T @ residual, rtol=1e-12, atol=1e-12 * np.abs(gradient).max())


def test_the_normal_matrix_is_summed_in_one_triangle_and_mirrored_band_by_band():
    """J^T J from syrk's upper triangle over several blocks, its lower half filled in bands narrower
    than the matrix: numpy's products of the whole J, exactly symmetric."""
    from mhaextract.rotary import refine
    rng = np.random.default_rng(4)
    blocks = [rng.normal(size=(n, 23)) for n in (5, 11, 2)]
    normal = np.zeros((23, 23), order="F")
    for J in blocks:
        refine.add_gram(normal, J)
    normal = refine.symmetric_from_upper(normal, width=7)
    J = np.vstack(blocks)
    assert np.allclose(normal, J.T @ J, rtol=1e-13, atol=1e-13 * np.abs(normal).max())
    assert np.array_equal(normal, normal.T)


def test_steps_on_an_older_normal_matrix_stop_where_exact_gauss_newton_stops(monkeypatch):
    """Steps that solve with J^T J formed at an earlier model (docs/algorithm.md, 'Rotary attention:
    positions, grouped heads and sliding windows', 'Refinement') take the model's own gradient, so
    they reach the fixed point of steps that form J^T J afresh every time: from a start 1e-3 off,
    both are the layer of the weights to rounding, the reused matrix forming fewer products."""
    from mhaextract.rotary import refine
    truth = mx.RotaryAttention.random(d=6, heads=2, head_width=4, seed=2, bias=True)
    rng = np.random.default_rng(4)
    sequences = [rng.normal(size=(int(n), 6)) * 6 ** -0.25
                 for n in rng.integers(2, 17, 3 * len(refine.pack(truth)))]
    answers = truth(sequences)
    Q, K, theta, v, b = (x * (1 + 1e-3 * rng.normal(size=x.shape)) for x in (truth.Q, truth.K, truth.theta, truth.v, truth.b))
    start = mx.RotaryAttention(Q, K, theta, v, truth.c, b=b)
    formed, original = [], refine.normal_equations

    def counted(*args, product=True, **options):
        formed.append(product)
        return original(*args, product=product, **options)

    monkeypatch.setattr(refine, "normal_equations", counted)
    reused, reused_report = refine.refine(start, sequences, answers)
    reused_products, gradients_alone = sum(formed), formed.count(False)
    formed.clear()
    monkeypatch.setattr(refine, "REUSE_GAIN", np.inf)  # J^T J formed at every step: exact Gauss-Newton
    exact, exact_report = refine.refine(start, sequences, answers)
    assert gradients_alone >= 2 and reused_products < sum(formed) and not formed.count(False)
    assert mx.compare(start, truth).max_rel >= 1e-4
    for model, report in ((reused, reused_report), (exact, exact_report)):
        assert report.residual_after <= 1e-13
        assert mx.compare(model, truth).max_rel <= 1e-11
    assert mx.compare(reused, exact).max_rel <= 1e-11


def _slow_blocks_in_a_wrong_basis(layer, seed):
    """The layer with every block turning less than 8e-3 per position set to angle 0 in a random
    basis: the same scores at offset 0, a start the eigenvalues of a noisy M give."""
    rng = np.random.default_rng(seed)
    Q, K, theta, b = layer.Q.copy(), layer.K.copy(), layer.theta.copy(), layer.b.copy()
    for h, m in zip(*np.nonzero(theta < 8e-3)):
        rows, S = slice(2 * m, 2 * m + 2), rng.normal(size=(2, 2))
        inverse = np.linalg.inv(S).T
        K[h, rows], Q[h, rows], b[h, rows] = S @ K[h, rows], inverse @ Q[h, rows], inverse @ b[h, rows]
        theta[h, m] = 0.0
    return mx.RotaryAttention(Q, K, theta, layer.v, layer.c, layer.window, b)


@pytest.mark.parametrize("key_bias", [False, True])
def test_the_generator_form_is_the_model_and_its_jacobian_and_gauge_are_exact(key_bias):
    """The slow blocks as exact generators (``GeneratorForm``): the same answers as the rotary model, the
    same model back from the real form, a Jacobian equal to central differences of the answers (the
    exponential's Frechet derivative by its series), and gauge directions the Jacobian is zero along."""
    from mhaextract.rotary import refine
    truth = mx.RotaryAttention.random(d=8, heads=2, head_width=8, seed=3, bias=True)
    if key_bias:
        truth = truth.replaced(key_bias=np.random.default_rng(4).normal(size=truth.b.shape))
    form = refine.GeneratorForm.of(truth, limit=5e-2)
    assert [len(rows) for rows in form.cluster] == [4, 4] and form.blocks == 4
    X = np.random.default_rng(5).normal(size=(6, 50, 8)) * 0.7
    assert np.abs(form(list(X)) - truth(list(X))).max() <= 1e-14
    assert mx.compare(form.to_rotary(), truth).max_rel <= 1e-12
    vector = refine.pack(form)
    assert np.array_equal(refine.pack(refine.unpack(vector, form)), vector)
    _, J = refine.jacobian(form, X)
    rng = np.random.default_rng(6)
    for part in (slice(0, len(vector)), slice(len(vector) - sum(o.size for o in form.omegas), len(vector))):
        move = np.zeros_like(vector)
        move[part] = rng.normal(size=move[part].shape) * 1e-2
        h = 1e-5
        ahead, behind = refine.unpack(vector + h * move, form), refine.unpack(vector - h * move, form)
        numeric = (ahead(list(X)) - behind(list(X))) / (2 * h)
        assert np.abs(numeric - J @ move).max() <= 1e-8 * np.abs(J @ move).max()
    # a generator turning its rows by more than the series' reach is no slow block: NaN answers, no warning
    runaway = refine.GeneratorForm(form.flat, form.cluster, [o * 1e3 for o in form.omegas])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert np.isnan(runaway(list(X))).all()
    gauge = form.gauge()
    assert gauge.shape == (len(vector), 2 * 2 * 2 + 2 * 16)  # two fast blocks a head, a 4 x 4 basis a head
    # a key bias's rows c are held (their columns vanish at Omega = 0): a change of basis of the rows then
    # moves the answers by what the held key rows score, and the fast blocks' gauge alone is exact
    exact = slice(None) if not key_bias else [i for i in range(gauge.shape[1]) if i % 20 < 4]
    assert np.abs(J @ gauge[:, exact]).max() <= 1e-12 * np.abs(J).max() * np.abs(gauge).max()


@pytest.mark.slow
@pytest.mark.parametrize("key_bias", [False, True])
def test_slow_blocks_in_a_wrong_basis_are_fitted_as_generators(key_bias):
    """A block at angle 0 in a wrong basis learns its basis only through terms of order theta delta, and
    the rotary steps crawl there; as exact generators the planes move linearly: a few Gauss-Newton steps
    take the misfit to rounding, and the real form gives the angles (1e-3 here, from 0) and the model.
    A start carrying a key bias (zero, as a run with ``key_bias=True`` starts) is fitted alike."""
    from mhaextract.rotary import refine
    truth = mx.RotaryAttention.random(d=16, heads=2, head_width=8, seed=0, bias=True)  # a scalar model
    start = _slow_blocks_in_a_wrong_basis(truth, 1)
    if key_bias:
        truth = truth.replaced(key_bias=np.zeros_like(truth.b))
        start = start.replaced(key_bias=np.zeros_like(start.b))
    rng = np.random.default_rng(2)
    sequences = [rng.normal(size=(int(n), 16)) * 16 ** -0.25 * 2 for n in rng.integers(2, 65, 1700)]
    answers = truth(sequences)
    form = refine.GeneratorForm.of(start, limit=5e-2)
    fitted, report = refine.refine(form, sequences, answers, iterations=12, estimate=False)
    assert report.iterations <= 10 and report.residual_after <= 1e-12
    model = fitted.to_rotary()
    assert np.allclose(np.sort(model.theta, axis=1), np.sort(truth.theta, axis=1), rtol=1e-8)
    assert mx.compare(model, truth).max_rel <= 1e-9
    # the rotary steps from the same start, as many: far from it
    crawled, _ = refine.refine(start, sequences, answers, iterations=report.iterations, estimate=False)
    assert mx.compare(crawled, truth).max_rel >= 1e3 * mx.compare(model, truth).max_rel


def test_steps_that_crawl_far_from_the_answers_stop():
    """``refine(crawl=...)``: the steps end after ``CRAWL_STEPS`` fresh steps in a row that each keep more than
    ``CRAWL_RATIO`` of the max misfit before them above ``crawl`` (here the rotary steps from slow blocks in a
    wrong basis, 7.7e-4, 7.4e-4, ...); the stop is where the rule, read off the same steps' trace without it,
    puts it, and a ``crawl`` above every misfit changes nothing."""
    from mhaextract.rotary import refine
    truth = mx.RotaryAttention.random(d=8, heads=2, head_width=8, seed=0, bias=True)
    start = _slow_blocks_in_a_wrong_basis(truth, 1)
    rng = np.random.default_rng(2)
    sequences = [rng.normal(size=(int(n), 8)) * 8 ** -0.25 * 2 for n in rng.integers(2, 33, 400)]
    answers = truth(sequences)

    def steps(crawl):
        trace = []
        _, report = refine.refine(start, sequences, answers, iterations=6, estimate=False, reuse_gain=np.inf,
                                  crawl=crawl, on_step=lambda step, misfit: trace.append(misfit))
        return report, trace

    free, trace = steps(np.inf)
    assert len(trace) == 6 and trace[-1] >= 1e-4   # crawling: far from the rounding after six steps
    crawl = 1e-4
    misfits = [free.residual_before] + trace
    slow = [misfits[i] > max(crawl, refine.CRAWL_RATIO * misfits[i - 1]) for i in range(1, len(misfits))]
    stop = next(i for i in range(refine.CRAWL_STEPS - 1, len(slow)) if all(slow[i - refine.CRAWL_STEPS + 1:i + 1])) + 1
    stopped, stopped_trace = steps(crawl)
    assert stopped.iterations == stop < 6 and stopped_trace == trace[:stop]
    assert stopped.residual_after == trace[stop - 1]
    assert steps(1.0)[1] == trace


def test_a_float32_start_whose_generator_steps_crawl_fails_loudly_before_the_rotary_steps(monkeypatch):
    """A float32 run's slow blocks fitted as generators (``seed_slow_blocks``, on half the polish queries) that end
    above ``CRAWL_MISFIT`` after crawling fail the ``start`` check at once, naming the misfits and what to try,
    with no model and no rotary steps (mistral-d64-h4/1 in float32 would crawl for up to an hour). Every step is
    made to count as crawling here, on a layer whose run passes otherwise."""
    import mhaextract.rotary.run as run
    from mhaextract.rotary import refine
    layer = mx.RotaryAttention.random(d=12, heads=2, head_width=6, seed=0, bias=True)
    monkeypatch.setattr(refine, "CRAWL_RATIO", 0.0)
    monkeypatch.setattr(run, "CRAWL_MISFIT", 0.0)
    rotary_steps = []
    monkeypatch.setattr(run.RotaryRun, "steps", lambda self, model, **options: rotary_steps.append(model))
    with pytest.warns(mx.UnreliableExtractionWarning):
        result = mx.extract(Float32Answers(layer), 12, heads=2, seed=0, positions="rotary", on_failure="warn",
                            progress=False)
    assert result.model is None and not rotary_steps and result.diagnostics["generator_blocks"] >= 1
    assert result.refinement.iterations == refine.CRAWL_STEPS
    # the generator steps fit half the polish queries (3 P of the start), at least 1.25 times the form's parameters
    polish = int(run.POLISH_FACTOR * len(refine.pack(result.start)))
    form = len(refine.pack(refine.GeneratorForm.of(result.start)))
    assert result.refinement.queries == max(int(run.GENERATOR_QUERIES * polish), int(run.GENERATOR_LEAST * form))
    assert result.refinement.queries < polish
    start = next(check for check in result.checks if check.name == "start")
    assert not start.passed and start.value == result.refinement.residual_after
    assert "generators left" in start.message and "try another seed" in start.message


@pytest.mark.slow
def test_a_refinement_larger_than_the_memory_available_is_refused_before_its_queries(monkeypatch):
    """The refinement holds its normal equations (P^2 numbers); where they would not fit the
    machine's available memory the run fails loudly, naming the size and the head width, before
    the polish queries are asked."""
    import mhaextract.rotary.run as run
    monkeypatch.setattr(run, "available_memory", lambda: 10**5)
    layer = mx.RotaryAttention.random(d=6, heads=2, head_width=4, seed=0)
    counted = CountingOracle(layer)
    with pytest.raises(mx.ExtractionError, match="(?s)refinement_memory.*head width 4.*GiB.*rank=") as caught:
        mx.extract(counted, d=6, heads=2, positions="rotary", seed=1, verify_length=0)
    assert caught.value.extraction.model is None
    monkeypatch.undo()
    full = CountingOracle(layer)
    result = mx.extract(full, d=6, heads=2, positions="rotary", seed=1, verify_length=0)
    assert result.ok and counted.queries == full.queries - result.refinement.queries  # no polish query asked


def test_a_value_fit_maps_the_refinements_own_error_draws_to_first_order():
    """The value fit's score part from error draws: a score error e moves the fitted V by the
    fit's first-order response to e, which the fit measures from e stretched and scaled back. With
    e itself as the only draw the score part is DRAW_SAFETY times the V change measured against a
    fit on the exact scores (the same answers, the truth's own read-out model)."""
    from mhaextract.run.value_fit import DRAW_SAFETY, fit_values
    from mhaextract.rotary.refine import error_moves, pack, unpack
    layer = mx.RotaryAttention.random(d=8, heads=2, head_width=4, seed=3, kv_heads=1, d_out=5, bias=True)
    r = np.random.default_rng(4).normal(size=5)
    exact = layer.readout(r)
    rng = np.random.default_rng(6)
    queries = [rng.normal(size=(int(n), 8)) * 8 ** -0.25 for n in rng.integers(2, 9, 60)]
    answers = layer(queries)
    vector = pack(exact)
    error = 1e-7 * np.abs(vector).max() * rng.standard_normal(len(vector))
    moved = unpack(vector + error, exact)
    on_exact = fit_values(exact, queries, answers, bias=True, readout=r)
    on_moved = fit_values(moved, queries, answers, bias=True, readout=r, score_moves=error_moves(moved, error[None]))
    change = float(np.abs(on_moved.model.V - on_exact.model.V).max())
    assert on_exact.score_error == 0 and change > 1e-12
    assert on_moved.score_error == pytest.approx(DRAW_SAFETY * change, rel=1e-3)


@pytest.mark.parametrize("seed", range(4))
def test_a_value_fit_judges_the_shifted_back_constant_by_its_own_error(seed):
    """With ``frame_shift`` s the constant reported is ``c + sum_h V_h s``, a linear functional of
    the fit: its estimate covers its error against the truth's own shifted-back constant (answers
    with noise 1e-9 of their size) without the slack of bounding it through |s|_1 times c's."""
    from mhaextract.run.value_fit import fit_values
    layer = mx.RotaryAttention.random(d=8, heads=2, head_width=4, seed=3 + seed, kv_heads=1, d_out=5, bias=True)
    r = np.random.default_rng(4).normal(size=5)
    rng = np.random.default_rng(6 + seed)
    queries = [rng.normal(size=(int(n), 8)) * 8 ** -0.25 for n in rng.integers(2, 9, 80)]
    answers = layer(queries)
    answers = answers + 1e-9 * np.abs(answers).max() * rng.standard_normal(answers.shape)
    shift = 2 * rng.normal(size=8)
    fit = fit_values(layer.readout(r), queries, answers, bias=True, readout=r, frame_shift=shift)
    reported = fit.model.c + np.einsum("hod,d->o", fit.model.V, shift)
    truth = layer.c + np.einsum("hod,d->o", layer.V, shift)
    constant_error = np.abs(reported - truth).max() / np.abs(truth).max()
    value_error = np.abs(fit.model.V - layer.V).max() / np.abs(layer.V).max()
    assert constant_error <= fit.error_estimate <= 6 * max(constant_error, value_error)


# -- a key bias (Qwen2): the key-neutral token and the shifted oracle ----------------------------

class KeyBiasedLayer:
    """A whole rotary layer with query, key and value biases written here from its weights (the
    reference oracle, independent of RotaryAttention): Q (H, r, d), K and W_V (H_kv, r, d) shared
    by the groups, W_O (d_out, H r), rotation on consecutive pairs, outputs at the final token
    attending its last ``window`` tokens (all without one)."""

    def __init__(self, d=8, heads=2, kv_heads=1, width=4, seed=0, key_bias_size=0.5, window=None):
        rng = np.random.default_rng(seed)
        self.d, self.H, self.kv, self.r = d, heads, kv_heads, width
        self.Wq = rng.normal(size=(heads, width, d)) / np.sqrt(d)
        self.bq = rng.normal(size=(heads, width)) * 0.3
        self.Wk = rng.normal(size=(kv_heads, width, d)) / np.sqrt(d)
        self.bk = rng.normal(size=(kv_heads, width)) * key_bias_size
        self.Wv = rng.normal(size=(kv_heads, width, d)) / np.sqrt(d)
        self.bv = rng.normal(size=(kv_heads, width)) * 0.3
        self.Wo = rng.normal(size=(d, heads * width)) / np.sqrt(heads * width)
        self.bo = rng.normal(size=d) * 0.1
        self.theta = 10000.0 ** (-np.arange(0, width, 2) / width)
        self.window = window
        self.queries = 0

    def rotate(self, v, angle):  # v (..., r) rotated by angle * theta on consecutive pairs
        pairs = v.reshape(v.shape[:-1] + (-1, 2))
        cos, sin = np.cos(angle * self.theta), np.sin(angle * self.theta)
        return np.stack([cos * pairs[..., 0] - sin * pairs[..., 1], sin * pairs[..., 0] + cos * pairs[..., 1]],
                        axis=-1).reshape(v.shape)

    def output(self, X):
        X = X if self.window is None else X[-self.window:]
        N = len(X)
        heads = []
        for h in range(self.H):
            g = h // (self.H // self.kv)
            query = self.Wq[h] @ X[-1] + self.bq[h]
            scores = np.array([(self.Wk[g] @ X[j] + self.bk[g]) @ self.rotate(query, N - 1 - j) for j in range(N)])
            a = np.exp(scores - scores.max())
            heads.append((a / a.sum()) @ (X @ self.Wv[g].T + self.bv[g]))
        return self.Wo @ np.concatenate(heads) + self.bo

    def __call__(self, batch):
        self.queries += len(batch)
        return np.array([self.output(np.asarray(X, dtype=np.float64)) for X in batch])

    def key_of(self, z):
        return np.einsum("grd,d->gr", self.Wk, z) + self.bk


def test_a_model_with_a_key_bias_is_the_layer_written_from_its_weights():
    layer = KeyBiasedLayer(seed=1)
    groups = np.arange(layer.H) // (layer.H // layer.kv)
    V = np.einsum("ohr,hrd->hod", layer.Wo.reshape(layer.d, layer.H, layer.r), layer.Wv[groups])
    c = layer.bo + layer.Wo @ layer.bv[groups].ravel()
    model = mx.RotaryAttention(layer.Wq, layer.Wk[groups], np.tile(layer.theta, (layer.H, 1)), V, c, b=layer.bq,
                               key_bias=layer.bk[groups])
    rng = np.random.default_rng(2)
    batch = [rng.normal(size=(int(n), layer.d)) for n in rng.integers(1, 40, 20)]
    assert np.abs(model(batch) - layer(batch)).max() <= 1e-12 * np.abs(layer(batch)).max()
    shift = rng.normal(size=layer.d)
    moved = [X + shift for X in batch]
    assert np.abs(model.with_token_shift(shift)(batch) - model(moved)).max() <= 1e-12 * np.abs(model(moved)).max()
    assert mx.compare(model.with_token_shift(shift).with_token_shift(-shift), model).max_rel <= 1e-12
    without = model.replaced(key_bias=None)
    assert np.abs(without(batch) - model(batch)).max() > 1e-3   # under rotation the key bias matters
    # a key bias in a block that does not rotate adds one score to every key: dropped, same function
    still = model.replaced(theta=np.where(np.arange(2) == 1, 0.0, model.theta))
    canonical = still.canonical()
    assert np.all(canonical.key_bias[:, 2:] == 0) and np.any(still.key_bias[:, 2:] != 0)
    assert np.abs(canonical(batch) - still(batch)).max() <= 1e-12 * np.abs(still(batch)).max()
    # the score matrices see that too, without the canonical form: their key-bias row is taken
    # relative to offset 0, so only the key bias of turning blocks shows, and it does
    W = still.identifying_matrices()
    assert np.all(W[:, 0, -1] == 0) and np.abs(W - canonical.identifying_matrices()).max() <= 1e-15 * np.abs(W).max()
    turned = still.replaced(key_bias=still.key_bias + np.where(np.arange(4) < 2, 1e-3, 0.0))
    assert np.abs(turned.identifying_matrices() - W).max() > 1e-5 * np.abs(W).max()


def test_the_refinements_jacobian_has_the_key_bias_columns():
    from mhaextract.rotary.refine import jacobian, pack, unpack
    model = mx.RotaryAttention.random(d=5, heads=2, head_width=4, seed=0, bias=True)
    model = model.replaced(key_bias=np.random.default_rng(0).normal(size=(2, 4)) * 0.3)
    X = np.random.default_rng(1).normal(size=(3, 6, 5))
    f, J = jacobian(model, X)
    vector = pack(model)
    assert len(vector) == len(pack(model.replaced(key_bias=None))) + 8
    numeric = np.stack([(unpack(vector + 1e-6 * e, model)(X) - unpack(vector - 1e-6 * e, model)(X)) / 2e-6
                        for e in np.eye(len(vector))], axis=1)
    assert np.abs(f - model(X)).max() <= 1e-14 and np.abs(J - numeric).max() <= 1e-8


@pytest.mark.slow
@pytest.mark.parametrize("seed", [0, 1])
def test_a_layer_with_a_key_bias_is_extracted_through_a_key_neutral_token(seed, tmp_path):
    layer = KeyBiasedLayer(d=8, heads=2, kv_heads=1, width=4, seed=seed)
    result = mx.extract(layer, d=8, heads=2, positions="rotary", key_bias=True, seed=0, schedule="rotary")
    assert result.ok and result.queries == layer.queries
    assert np.abs(layer.key_of(result.neutral.token)).max() <= 1e-8 * np.abs(layer.bk).max()
    assert result.neutral.queries < result.queries
    rng = np.random.default_rng(7)
    fresh = [rng.normal(size=(int(n), 8)) * 8 ** -0.25 for n in rng.integers(1, 257, 200)]
    truth = layer(fresh)
    assert np.abs(result.model(fresh) - truth).max() <= 1e-10 * np.abs(truth).max()
    assert result.error_estimate <= 1e-8
    assert result.summary()["key_neutral_queries"] == result.neutral.queries
    loaded = mx.load_model(mx.save_extraction(result, tmp_path / "key_bias.json")[0])
    assert all(np.array_equal(getattr(loaded, name), getattr(result.model, name))
               for name in ("Q", "K", "b", "key_bias", "theta", "V", "c"))


@pytest.mark.slow
@pytest.mark.parametrize("window", [9, 16])
def test_a_key_bias_under_a_sliding_window_is_found_within_it(window):
    """The window is found before the key-neutral token ((y, 0^(L-1)) answers c once y left it,
    key bias or not) and the search keeps every sequence in it: at 9 tokens (the instances'
    shortest for two heads) its lengths are 2, 3, 4, 5, 6, 8, 9 and its query changes three times as many."""
    layer = KeyBiasedLayer(d=8, heads=2, kv_heads=1, width=4, seed=0, window=window)
    result = mx.extract(layer, d=8, heads=2, positions="rotary", key_bias=True, seed=0, schedule="rotary")
    assert result.ok and result.window == window and result.queries == layer.queries
    assert np.abs(layer.key_of(result.neutral.token)).max() <= 1e-8 * np.abs(layer.bk).max()
    rng = np.random.default_rng(7)
    fresh = [rng.normal(size=(int(n), 8)) * 8 ** -0.25 for n in rng.integers(1, 4 * window + 1, 200)]
    truth = layer(fresh)
    assert np.abs(result.model(fresh) - truth).max() <= 1e-10 * np.abs(truth).max()


def test_a_window_too_short_for_the_instances_stops_before_the_key_neutral_search():
    layer = KeyBiasedLayer(d=8, heads=2, kv_heads=1, width=4, seed=0, window=8)
    with pytest.raises(mx.ExtractionError, match="window") as failure:
        mx.extract(layer, d=8, heads=2, positions="rotary", key_bias=True, seed=0, schedule="rotary")
    result = failure.value.extraction
    assert result.window == 8 and result.neutral is None and result.queries == layer.queries < 30


def test_the_large_query_criterion_vanishes_at_a_neutral_token_whatever_the_self_scores():
    """docs/algorithm.md, 'From float32 answers': with finals z* + w the answers' part off the shapes
    (N - 1) / N^(k+2) is zero at the key-neutral token although the finals' self-scores (0.3 here)
    move the answers by a tenth, and a key of 1e-4 left in z stands out of it."""
    from mhaextract.rotary.neutral import off_shape_misfit, pair_misfit
    layer = KeyBiasedLayer(d=8, heads=2, kv_heads=1, width=4, seed=0)
    Wk, bk = layer.Wk.reshape(-1, 8), layer.bk.ravel()
    neutral = -np.linalg.lstsq(Wk, bk, rcond=None)[0]      # from the weights: the test's own truth
    rng = np.random.default_rng(1)
    offsets = rng.normal(size=(2, 8))
    offsets *= 0.3 / np.linalg.norm(offsets, axis=1, keepdims=True)

    def whole(sequences, description):
        return layer(sequences)
    lengths = (2, 3, 5, 8, 13, 20, 32, 51)
    self_scores = [(layer.Wq[h] @ (neutral + w) + layer.bq[h]) @ (Wk @ (neutral + w) + bk) for w in offsets
                   for h in range(2)]
    at_neutral = np.abs(off_shape_misfit(whole, neutral, offsets, lengths)).max()
    keyed = neutral + np.linalg.lstsq(Wk, rng.normal(size=4) * 1e-4, rcond=None)[0]
    assert np.abs(self_scores).max() >= 0.2 and np.abs(pair_misfit(whole, neutral, offsets)).max() >= 0.1
    assert at_neutral <= 1e-7
    assert np.abs(off_shape_misfit(whole, keyed, offsets, lengths)).max() >= 10 * at_neutral


def test_the_pair_misfit_is_zero_exactly_where_the_finals_self_scores_are():
    from mhaextract.rotary.neutral import pair_misfit
    layer = KeyBiasedLayer(d=8, heads=1, kv_heads=1, width=4, seed=2)
    Wk, bk = layer.Wk.reshape(-1, 8), layer.bk.ravel()
    neutral = -np.linalg.lstsq(Wk, bk, rcond=None)[0]
    # an offset in null(K) leaves the final's key zero: self-score zero, uniform attention
    null_offset = np.linalg.svd(Wk)[2][-1] * 2.0
    whole = lambda sequences, description: layer(sequences)
    assert np.abs(pair_misfit(whole, neutral, [null_offset])).max() <= 1e-12
    assert np.abs(pair_misfit(whole, neutral, [np.linalg.svd(Wk)[2][0]])).max() >= 1e-3


def test_a_float32_run_under_a_window_too_short_for_the_large_query_search_is_refused():
    """Float32 answers take the key-neutral token from counts up to 2048; a window of 16 leaves
    five of them: the run stops at its key_bias check after the window search, naming the window."""
    from mhaextract.rotary.neutral import LARGE_QUERY_MIN_WINDOW
    layer = KeyBiasedLayer(d=8, heads=2, kv_heads=1, width=4, seed=0, window=16)
    with pytest.raises(mx.ExtractionError, match=r"key_bias.*sliding window") as failure:
        mx.extract(Float32Answers(layer), d=8, heads=2, positions="rotary", key_bias=True, seed=0, schedule="rotary")
    result = failure.value.extraction
    assert result.window == 16 < LARGE_QUERY_MIN_WINDOW and result.neutral is None
    assert result.queries == layer.queries < 100


@pytest.mark.slow
def test_the_refinements_key_prior_is_weighed_against_the_misfit():
    """The key bias's prior is ``(sigma / key_size)^2 |k|^2`` with sigma the misfit's root mean
    square at each step (docs/algorithm.md, 'Rotary attention: positions, grouped heads and sliding windows'). Without a
    prior the refinement fits a key bias of 0.3 from 0 (to 1%: the other parameters nearly take up one combination of
    it, the walk a float32 run must not take); a prior of the key's size leaves the fit to the answers; a prior far
    below the key holds it near 0 whatever the misfit, which stays large: a residual check a run fails loudly."""
    from mhaextract.rotary.refine import refine
    truth = mx.RotaryAttention.random(d=4, heads=1, head_width=2, seed=1, bias=True)
    truth = truth.replaced(key_bias=np.array([[0.3, -0.2]]))
    rng = np.random.default_rng(3)
    sequences = [rng.normal(size=(int(n), 4)) * 4 ** -0.25 for n in rng.integers(2, 12, 120)]
    answers = truth(sequences)
    start = truth.replaced(key_bias=np.zeros((1, 2)))
    free, fitted = refine(start, sequences, answers, iterations=40, estimate=False)
    sized, sized_fit = refine(start, sequences, answers, iterations=40, estimate=False, key_size=0.3)
    held, held_fit = refine(start, sequences, answers, iterations=40, estimate=False, key_size=1e-4)
    assert fitted.residual_after <= 1e-12 and sized_fit.residual_after <= 1e-12
    assert np.linalg.norm(free.key_bias - truth.key_bias) <= 1e-2 * np.linalg.norm(truth.key_bias)
    assert np.linalg.norm(sized.key_bias - truth.key_bias) <= 5e-2 * np.linalg.norm(truth.key_bias)
    assert np.linalg.norm(held.key_bias) <= 1e-2 * np.linalg.norm(truth.key_bias)
    assert held_fit.residual_after >= 1e-2


def test_the_key_neutral_search_refuses_a_window_without_lengths_to_spare():
    from mhaextract.rotary.neutral import find_neutral_token
    layer = KeyBiasedLayer(d=8, heads=1, kv_heads=1, width=4, seed=0, window=4)
    boundary = OracleBoundary(layer, 8)
    with pytest.raises(ValueError, match="window of at least 5 tokens, got 4"):
        find_neutral_token(boundary, np.zeros(8), np.random.default_rng(0), 1.0, window=4)
    with pytest.raises(ValueError, match="window of at least 33 tokens, got 32"):
        find_neutral_token(boundary, np.zeros(8), np.random.default_rng(0), 1.0, window=32, heads=1, coarse=True)
    with pytest.raises(ValueError, match="pass heads="):
        find_neutral_token(boundary, np.zeros(8), np.random.default_rng(0), 1.0, coarse=True)
    assert layer.queries == 0


@pytest.mark.slow
def test_key_bias_on_a_layer_without_biases_is_no_false_alarm():
    """``key_bias=True`` on a Llama-like layer (no biases at all): the neutral token is 0 to the
    search's precision, the constant of the shifted frame is that token's value alone, and the
    constant reported (zero) is judged, not the shifted one relative to its own tiny size."""
    layer = KeyBiasedLayer(d=8, heads=2, kv_heads=1, width=4, seed=0)
    for bias in (layer.bq, layer.bk, layer.bv, layer.bo):
        bias[...] = 0.0
    result = mx.extract(layer, d=8, heads=2, positions="rotary", key_bias=True, seed=0, schedule="rotary")
    assert result.ok and np.linalg.norm(result.neutral.token) <= 1e-6
    frame = result.diagnostics["shifted_frame"]   # the frame's constant: the token's value, V z* (0 here)
    assert frame["token_norm"] == pytest.approx(np.linalg.norm(result.neutral.token), rel=1e-12)
    assert frame["layer_constant"] == 0.0 and frame["constant"] <= 1e-6
    rng = np.random.default_rng(7)
    fresh = [rng.normal(size=(int(n), 8)) * 8 ** -0.25 for n in rng.integers(1, 257, 100)]
    truth = layer(fresh)
    assert np.abs(result.model(fresh) - truth).max() <= 1e-10 * np.abs(truth).max()
    assert result.error_estimate <= 1e-8 and np.abs(result.model.c).max() <= 1e-8


def test_a_failed_start_names_a_key_bias_only_where_the_self_instances_show_one():
    """Issue 64: a start that failed without ``key_bias`` hinted at a key bias on a layer without biases. The
    hint follows the basis tokens' self instances: misfits far above the answers' rounding (an exact Qwen2
    layer's key bias: 7e-3) name the key bias; misfits at it (mistral-d64-h4/0 in float32) name crowded poles
    and the layer in float64."""
    import types

    from mhaextract.rotary.run import _start_hint
    run = types.SimpleNamespace(unit=2.0 ** -24, self_misfit=7e-3, answer_dtype="float32")
    assert "try key_bias=True" in _start_hint(run) and "7.0e-03" in _start_hint(run)
    run.self_misfit = 2e-7
    hint = _start_hint(run)
    assert "key_bias" not in hint and "crowd" in hint and "layer.double()" in hint
    run.answer_dtype = "float64"                    # a float64 layer computing in float32 inside: its exact copy
    assert "float64_layer" in _start_hint(run)
    run.unit, run.self_misfit = 2.0 ** -53, 1e-15   # exact float64 answers: no float64 to go to
    assert "key_bias" not in _start_hint(run) and "layer.double()" not in _start_hint(run)
    run.self_misfit = None                          # a given token scale: no self instances asked
    assert "try key_bias=True" in _start_hint(run)


def test_a_failed_key_bias_start_from_float32_answers_names_its_frame_and_what_to_try():
    """docs/trained-layers.md: both zoo Qwen2 layers get no start in float32, asked in a frame whose output
    constant is 12..20 times the layer's own, and extract in float64; float64 answers get no such hint."""
    import types

    from mhaextract.rotary.run import _shifted_frame_hint
    run = types.SimpleNamespace(unit=2.0 ** -24, answer_dtype="float32",
                                shifted_frame={"token_norm": 9.8, "constant": 0.61, "layer_constant": 0.031})
    hint = _shifted_frame_hint(run)
    assert "(norm 9.8)" in hint and "0.61 against its own 0.031" in hint and "layer.double()" in hint
    run.answer_dtype = "float64"   # answers computed in float32 inside a float64 layer: its exact copy
    assert "float64_layer" in _shifted_frame_hint(run) and "layer.double()" not in _shifted_frame_hint(run)
    run.unit = 2.0 ** -53
    assert _shifted_frame_hint(run) == ""


@pytest.mark.slow
def test_a_key_bias_needs_whole_answers_and_grouped_heads():
    scalar = KeyBiasedRotary(mx.RotaryAttention.random(d=4, heads=1, head_width=2, seed=3, bias=True),
                             np.array([[0.8, -0.6]]))
    with pytest.raises(mx.ExtractionError, match="from whole answers"):
        mx.extract(scalar, d=4, heads=1, positions="rotary", key_bias=True, seed=0, schedule="rotary")
    every_head = KeyBiasedLayer(d=4, heads=2, kv_heads=2, width=2, seed=0)   # n_kv r = d: no invisible token
    with pytest.raises(mx.ExtractionError, match="value_null_space"):
        mx.extract(every_head, d=4, heads=2, positions="rotary", key_bias=True, seed=0, schedule="rotary")


@pytest.mark.parametrize("options,message", [
    ({"positions": "none", "key_bias": True}, "key_bias \\(an option of 'rotary', 'rotary-split'\\)"),
    ({"positions": "rotary", "key_bias": "yes"}, "key_bias must be True or False"),
    ({"positions": "rotary", "key_bias": True, "precision": 128}, "runs in float64"),
])
def test_bad_key_bias_options_are_named(options, message):
    layer = mx.RotaryAttention.random(d=4, heads=1, head_width=2, seed=0)
    with pytest.raises(ValueError, match=message):
        mx.extract(mx.SimulatedOracle(layer), d=4, heads=1, **options)


def test_a_key_bias_in_high_precision_is_evaluated_in_balls():
    model = mx.RotaryAttention.random(d=4, heads=1, head_width=2, seed=1, bias=True)
    model = model.replaced(key_bias=np.array([[0.4, -0.3]]))
    exact = model.to_mpf()
    assert exact.is_high_precision and exact.key_bias.dtype == object and exact.precision == 53
    X = np.random.default_rng(0).normal(size=(2, 5, 4))
    high = np.array(exact(X, precision=128), dtype=np.float64)
    assert np.abs(high - model(X)).max() <= 1e-14 * np.abs(model(X)).max()
    assert mx.RotaryAttention.random(d=4, heads=1, head_width=2, seed=1).to_mpf().precision == 53  # no key bias


def test_finals_held_at_half_weight_have_self_scores_log_e_and_the_criterion_sees_a_slow_key():
    """docs/algorithm.md, 'Finals at half weight for the slow blocks': the Gauss-Newton steps on
    ``2 f(z^(M-1), z + w) - f(z) - f(z + w)`` give the final the self-score ``log(M - 1)`` in every head
    (read here from the weights), and the part of ``Y_N`` off the shapes ``(d / d log E)^k E / (E + N - 1)``
    is zero at the key-neutral token while a key of 1e-4 left in the slow block (theta = 0.01) stands out."""
    from mhaextract.rotary.neutral import half_weight_misfit, hold_self_scores
    layer = KeyBiasedLayer(d=8, heads=2, kv_heads=1, width=4, seed=0)
    Wk, bk = layer.Wk.reshape(-1, 8), layer.bk.ravel()
    neutral = -np.linalg.lstsq(Wk, bk, rcond=None)[0]      # from the weights: the test's own truth
    rng = np.random.default_rng(2)
    whole = lambda sequences, description: layer(sequences)
    count, finals = 9, []
    for w in rng.normal(size=(2, 8)):
        for step_count in (2, 3, 5, count):                 # raised by factors of about 2, as the search does
            w, misfit = hold_self_scores(whole, neutral, w, 2, rng, step_count, 3)
        assert misfit <= 1e-8
        scores = [(layer.Wq[h] @ (neutral + w) + layer.bq[h]) @ (Wk @ (neutral + w) + bk) for h in range(2)]
        assert np.allclose(scores, np.log(count - 1), atol=1e-6)
        finals.append(w)
    lengths = (2, 4, 8, 16, 32, 64, 96)
    finals = [neutral + w for w in finals]                  # the final tokens stay where they are as z moves
    at_neutral = np.abs(half_weight_misfit(whole, neutral, finals, lengths, count - 1.0)).max()
    slow_key = np.array([0.0, 0.0, 1e-4, 0.0])              # the block of theta = 0.01
    keyed = neutral + np.linalg.lstsq(Wk, slow_key, rcond=None)[0]
    assert at_neutral <= 1e-9
    assert np.abs(half_weight_misfit(whole, keyed, finals, lengths, count - 1.0)).max() >= 100 * at_neutral


@pytest.mark.slow
def test_the_half_weight_steps_hold_their_finals_again_as_the_key_moves():
    """docs/algorithm.md, 'Finals at half weight for the slow blocks': from a token leaving a slow key
    of 3e-2 (qwen2-d32-h4/0's large-query search left 3.8e-2), the finals held at half weight at that
    token are off ``log E`` once the first step has moved the key, and the criterion stalls at their
    own misfit (a key of 7.7e-4 left) unless they are held again before each step (1.8e-6)."""
    from mhaextract.rotary.neutral import half_weight_search, hold_self_scores, off_shape_misfit
    layer = KeyBiasedLayer(d=8, heads=2, kv_heads=1, width=4, seed=0)
    Wk, bk = layer.Wk.reshape(-1, 8), layer.bk.ravel()
    neutral = -np.linalg.lstsq(Wk, bk, rcond=None)[0]      # from the weights: the test's own truth
    key = np.array([1e-3, -1e-3, 3e-2, -2e-2])              # the slow block (theta = 0.01) far off
    start = neutral + np.linalg.lstsq(Wk, key, rcond=None)[0]
    whole = lambda sequences, description: layer(sequences)
    rng = np.random.default_rng(3)
    lengths = (2, 3, 5, 8, 13, 20, 32, 51)
    offsets = np.array([hold_self_scores(whole, start, w, 2, rng)[0] for w in rng.normal(size=(2, 8)) * 0.5])
    criterion = lambda z, offsets: off_shape_misfit(whole, z, offsets, lengths)
    here = criterion(start, offsets)
    jacobian = np.column_stack([(criterion(start + 1e-6 * e, offsets) - here) / 1e-6 for e in np.eye(8)])
    z, misfit = half_weight_search(whole, start, offsets, jacobian, criterion, 2, rng, 1.0, 256)
    assert np.abs(Wk @ z + bk).max() <= 1e-3 * np.abs(key).max()
    assert misfit <= 1e-5


@pytest.mark.parametrize("options,message", [
    ({"polish_factor": 0}, "polish_factor must be a positive number"),
    ({"value_factor": "4"}, "value_factor must be a positive number"),
    ({"value_factor": True}, "value_factor must be a positive number"),
])
def test_bad_query_factors_are_named(options, message):
    layer = mx.RotaryAttention.random(d=4, heads=1, head_width=2, seed=0)
    with pytest.raises(ValueError, match=message):
        mx.extract(mx.SimulatedOracle(layer), d=4, heads=1, positions="rotary", **options)


def test_a_token_bound_scales_the_random_queries_tokens_onto_it():
    # the rotary run's polish and value read-out queries under an oracle's token_bound: none beyond it, those
    # within it unchanged, the others in their own directions
    from mhaextract.oracle.queries import random_queries

    free = random_queries(np.random.default_rng(0), 50, 8, 2.0, (2, 16))
    bounded = random_queries(np.random.default_rng(0), 50, 8, 2.0, (2, 16), bound=2.1)
    norms = np.concatenate([np.linalg.norm(X, axis=1) for X in free])
    assert (norms > 2.1).any() and (norms < 2.1).any()
    for X, Y in zip(free, bounded):
        inside = np.linalg.norm(X, axis=1) <= 2.1
        assert np.array_equal(X[inside], Y[inside])
        assert np.allclose(np.linalg.norm(Y[~inside], axis=1), 2.1)
        assert np.allclose(Y[~inside] / np.linalg.norm(Y[~inside], axis=1)[:, None],
                           X[~inside] / np.linalg.norm(X[~inside], axis=1)[:, None])
