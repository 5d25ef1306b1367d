"""The families of layers mhaextract learns: importing each registers its learners
(:mod:`mhaextract.run.learner`). A new family is a folder with a ``learner.py`` and one line here."""

from .attention import learner as attention  # noqa: F401  the schedules: paper, lean, targeted, lowrank
from .lowprecision import learner as lowprecision  # noqa: F401  saturated
from .vector import learner as vector  # noqa: F401
from .rotary import learner as rotary  # noqa: F401
from .transformer import learner as transformer  # noqa: F401
from .norm import learner as norm  # noqa: F401  attention behind a LayerNorm or RMSNorm, with the residual
