"""The attention sublayer of a pre-norm or post-norm block as a learner ("norm", docs/algorithm.md,
'Attention behind a norm: the sublayer of a block'): ``extract(oracle, d, heads=H, norm="auto")``."""

from __future__ import annotations

from ..run.learner import Learner, learner_class, learner_names, register_learner
from .learn import DIRECT_FIT, ROTARY, run_normed
from .sweeps import POST_NORM

#: What ``norm=`` takes.
NORM_OPTIONS = ("auto", "layernorm", "rmsnorm", POST_NORM)


@register_learner
class NormedLearner(Learner):
    """The norm's kind, eps and the residual from one-token sweeps, the inner heads by an attention
    learner on the reduced oracle, the whole sublayer verified on raw sequences."""

    name = "norm"
    family = "norm"
    model = ("attention behind a LayerNorm or RMSNorm, with the residual (a pre-norm block's sublayer; rotary attention "
             "behind an RMSNorm: Llama's), or attention and the residual behind a LayerNorm (a post-norm block's, "
             "BertAttention)")
    options = {
        "norm": "the sublayer's norm: 'auto' (found from answers), 'layernorm' or 'rmsnorm' (before the attention), "
                "'post-layernorm' (after the residual)",
        "inner_schedule": "how the inner heads are learned from the reduced oracle: 'fit' (default: a direct fit of "
                          "whole answers from bounded tokens) or an attention schedule's name ('paper': the biased grid)",
        "positions": "'rotary': the attention behind the norm is rotary (Llama's sublayer), learned by the rotary "
                     "learner on the reduced oracle at a token scale inside the ball",
    }
    defaults = {"norm": "auto", "inner_schedule": DIRECT_FIT, "positions": "none"}
    refusal = "the norm family learns the norm, eps and residual itself and the inner heads by its own fit"
    # before the rotary learner: norm= with positions='rotary' is a rotary sublayer, this learner's
    priority = -1

    @classmethod
    def claims(cls, options, common) -> bool:
        return options.get("norm") is not None and options.get("norm") != "none"

    @classmethod
    def explains(cls, evidence) -> str | None:
        """A failed ``"auto"`` run whose probes found a norm (``normalised``: before the attention or after the
        residual) hands its session to this learner, ``norm="auto"``: the defaults find a block's sublayer."""
        # whole answers only: a read-out's run is learned with norm= named (its hint says so)
        if not getattr(evidence, "normalised", False) or getattr(evidence, "d_out", 1) < 2:
            return None
        return (f"scaling a lone token did not scale its effect (f(2x) - 2f(x) + f(0) reached "
                f"{evidence.curvature:.2g} of the largest answer), as a norm before the attention or after the "
                "residual does: the sublayer of a block, learned by the norm learner (norm='auto')")

    @classmethod
    def validate(cls, options, common) -> dict:
        options = {**cls.defaults, **{k: v for k, v in options.items() if v is not None}}
        if options["norm"] not in NORM_OPTIONS:
            raise ValueError(f"norm must be one of {NORM_OPTIONS} (the sublayer's norm), got "
                             f"{options['norm']!r}; plain attention without a norm: extract without norm=")
        schedule = options["inner_schedule"]
        if options["positions"] not in ("none", ROTARY):
            raise ValueError(f"positions must be 'none' or 'rotary' (Llama's sublayer: rotary attention behind an "
                             f"RMSNorm), got {options['positions']!r}")
        if options["positions"] == ROTARY:
            if schedule != DIRECT_FIT:
                raise ValueError("positions='rotary' learns the inner heads by the rotary learner: leave "
                                 f"inner_schedule unset, got {schedule!r}")
            if common.heads is None:
                raise ValueError("positions='rotary' needs the head count: pass heads=H (the query heads)")
            if options["norm"] in ("layernorm", POST_NORM):
                raise ValueError(f"positions='rotary' is learned behind an RMSNorm before the attention (Llama's "
                                 f"sublayer), not norm={options['norm']!r}: pass norm='auto' or 'rmsnorm'")
            options["inner_schedule"] = ROTARY
        elif schedule == DIRECT_FIT:
            if common.heads is None:
                raise ValueError("the direct fit (inner_schedule='fit') needs the head count: pass heads=H (a bound "
                                 "max_heads is taken by inner_schedule='paper')")
        elif not isinstance(schedule, str) or schedule not in learner_names() or learner_class(schedule).family != "attention":
            raise ValueError(f"inner_schedule must be 'fit' or name a schedule of the attention family ('paper', "
                             f"'targeted', 'lowrank', ...), got {schedule!r}")
        if common.precision is not None:
            raise ValueError("the norm family runs in float64 (the raw layer's answers); pass precision=None")
        return options

    def run(self):
        return run_normed(self.session, self.options)
