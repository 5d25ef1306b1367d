"""The attention family's schedules as learners: one :class:`ScheduleLearner` per schedule of
:mod:`mhaextract.attention.registry` ("paper", "lean", "targeted", "lowrank"), made by
:func:`learner_for` for each schedule registered (``attention.registry.register``, one line); each runs :func:`~mhaextract.attention.extraction.run_attention`.
"""

from __future__ import annotations

from ..run.learner import AUTO, LEARNERS, Learner, register_learner
from ..run.validation import bias_option
from .registry import ON_REGISTER, SCHEDULES, choose

#: The options of ``extract`` the attention family's schedules read (each schedule refuses those of
#: them it does not support, through ``Schedule.accepts``).
OPTIONS = {
    "bias": "learn score biases u_h and the output constant c ('Biases: affine scores and an output constant')",
    "samples_per_instance": "copy counts per instance (float64, paper)",
    "refine": "least-squares polish and certificate (float64)",
    "refine_queries": "fresh polish queries of the refinement",
    "answer_error": "a bound on every answer's absolute error (float64)",
    "rank": "a bound on the rank of every W_h, or 'auto' (lowrank)",
    "backend": "float64 kernels: 'numpy', 'torch', 'torch-cpu', 'torch-cuda' (grid schedules)",
    "repair": "re-measure instances that fail the Krawczyk test (high precision, grid)",
}


class ScheduleLearner(Learner):
    """A schedule of the attention family (:mod:`mhaextract.attention.registry`) as a learner.
    ``schedule_name``: the registry name of its schedule (the learner's name too)."""

    family = "attention"
    model = "multi-head attention (W_h, v_h or V_h, u_h, c)"
    options = OPTIONS
    priority = 100  # "auto" asks it last: it takes every layer the others do not claim

    @classmethod
    def claims(cls, options, common) -> bool:
        """``"auto"``: the schedule :func:`~mhaextract.attention.registry.choose` resolves."""
        chosen = choose(AUTO, common.d, common.max_heads, common.precision, options.get("bias"), options.get("rank"))
        return chosen.schedule.name == cls.name

    @classmethod
    def validate(cls, options, common) -> dict:
        return dict(options, bias=bias_option(options.get("bias")))

    @classmethod
    def fixed_queries(cls, request, options):
        """The queries of the schedule (bias-free unless ``options["bias"]``) known before any answer."""
        from ..run.validation import token_scale_for
        from .base import RunSettings
        from .registry import BIASED

        schedule = cls.schedule_class
        if options.get("bias"):
            schedule = BIASED[schedule]
        scale = None if request.token_scale == "auto" else request.token_scale
        settings = RunSettings(request.d, request.max_heads, request.heads, request.precision, request.seed,
                               token_scale_for(request.d, scale), bias=bool(options.get("bias")))
        return schedule(settings).fixed_queries()

    def run(self):
        from .extraction import run_attention

        # "auto" keeps its own defaults (biases, calibration) and reason through choose()
        return run_attention(self.session, self.options, AUTO if self.session.requested == AUTO else self.name)


def learner_for(schedule) -> type[ScheduleLearner]:
    """The learner that runs ``schedule`` (a registered :class:`~.base.Schedule` subclass)."""
    # every option of the family: each value is checked first (settings_for), then the schedule
    # refuses those it does not support (Schedule.accepts), with its reason
    return type(f"{schedule.__name__}Learner", (ScheduleLearner,), {
        "name": schedule.name, "__module__": schedule.__module__, "refusal": schedule.refusal,
        "__doc__": f"The {schedule.name!r} schedule of the attention family as a learner."})


def _register(schedule) -> None:
    if getattr(LEARNERS.get(schedule.name), "schedule_class", None) is not schedule:
        learner = learner_for(schedule)
        learner.schedule_class = schedule
        LEARNERS.pop(schedule.name, None)
        register_learner(learner)


ON_REGISTER.append(_register)
for _schedule in list(SCHEDULES.values()):
    _register(_schedule)
