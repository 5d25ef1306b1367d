"""The targeted family: one head in the window of every instance, float64, H <= d (docs/algorithm.md
'The targeted schedule', 'Biases: affine scores and an output constant' and 'Low-rank heads').

Modules, in the order a run uses them:

* :mod:`.schedule` - the driver: :class:`TargetedSchedule` and its run (phase 1, first group,
  bridges, final stage);
* :mod:`.linesearch` - phase 1, heads located along lines;
* :mod:`.prober` - copies-instances asked through the oracle boundary;
* :mod:`.patterns`, :mod:`.designs` - the final tokens of each unit's instances;
* :mod:`.measure` - the instances asked chunk by chunk and fitted;
* :mod:`.bases` - the final stage's balanced bases;
* :mod:`.diagnostics` - per-instance diagnostics, error estimate, checks;
* :mod:`.tolerances` - the constants and tolerances they share;
* :mod:`.biased` - the model with biases ('Biases: affine scores and an output constant'); :mod:`.lowrank` - heads of
  rank at most r ('Low-rank heads').
"""

from .biased import BiasedTargetedSchedule
from .lowrank import BiasedLowRankSchedule, LowRankSchedule
from .schedule import TargetedSchedule

__all__ = ["BiasedLowRankSchedule", "BiasedTargetedSchedule", "LowRankSchedule", "TargetedSchedule"]
