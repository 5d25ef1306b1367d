"""Query schedules: each one module behind the :class:`~.base.Schedule` interface, found by name in
:mod:`.registry`. The grid schedules (paper §5, lean §10) share :mod:`.grid`; the targeted schedule
(§13) is :mod:`.targeted` with its line search :mod:`.linesearch`."""
