"""Query schedules: each one module behind the :class:`~.base.Schedule` interface, found by name in
:mod:`.registry`. The grid schedules (docs/algorithm.md, 'The paper schedule' and 'The lean schedule')
share :mod:`.grid`; the targeted schedule ('The targeted schedule') is :mod:`.targeted` with its line
search :mod:`.linesearch`."""
