"""The one-layer Transformer as a learner ("transformer", docs/algorithm.md, 'The one-layer
Transformer'): attention, then a bias-free ReLU FFN. Named by :func:`extract_transformer`
(``extract(..., schedule="transformer", hidden=...)`` is the same run)."""

from __future__ import annotations

from ..run.learner import Learner, register_learner
from .learn import run_transformer


@register_learner
class TransformerLearner(Learner):
    """Step 1: the odd part's heads (the attention family's learner on g(X) = f(X) - f(-X));
    step 2: the ReLU units through the known attention (:mod:`mhaextract.transformer.learn`)."""

    name = "transformer"
    family = "transformer"
    model = "one-layer Transformer (attention, then a bias-free ReLU FFN)"
    options = {
        "hidden": "the number of hidden units, if known",
        "residual": "the FFN reads o(X) + x_N",
        "max_segments": "at most this many segment pairs in step 2",
        "quiet_segments": "stop after this many segment pairs in a row found nothing new",
        "verify_queries": "fresh random queries the result is checked on (default 4 H d + 32)",
    }
    refusal = "the Transformer's step 1 runs the attention family's default schedule on the odd part"

    def run(self):
        return run_transformer(self.session, self.options)
