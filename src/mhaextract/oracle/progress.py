"""Progress bars on stderr: one bar per :func:`mhaextract.extract` run, and standalone bars.

A run's bar (:class:`RunProgress`) is one rich task whose description names the stage being asked
(the calibration's probes, the schedule's rounds, the refinement's polish queries, the
verification), with the queries asked so far against those expected and an estimate of the time
left. It is drawn on stderr, so a redirected stdout stays clean, and only when stderr is a terminal
unless ``progress=True`` asks for it.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import sys


def shown(progress) -> bool:
    """Whether a bar is drawn: ``progress`` if given (True/False), else whether stderr is a terminal."""
    return bool(progress) if progress is not None else sys.stderr.isatty()


def _columns():
    from rich.progress import (
        BarColumn, MofNCompleteColumn, TextColumn, TimeElapsedColumn, TimeRemainingColumn,
    )
    return (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
            TextColumn("eta"), TimeRemainingColumn())


def _bar():
    from rich.console import Console
    from rich.progress import Progress
    return Progress(*_columns(), console=Console(stderr=True), transient=True)


class ProgressBar:
    """A standalone rich bar on stderr (or nothing) as a context manager yielding ``advance(n)``."""

    def __init__(self, show: bool, description: str, total: int, completed: int = 0):
        self.show, self.description, self.total, self.completed = show, description, total, completed

    def __enter__(self):
        if not self.show:
            return lambda n: None
        self._bar = _bar()
        self._bar.__enter__()
        task = self._bar.add_task(self.description, total=self.total, completed=self.completed)
        return lambda n: self._bar.advance(task, n)

    def __exit__(self, *exc):
        if self.show:
            self._bar.__exit__(*exc)
        return False


class RunProgress:
    """The single bar of one run: every oracle boundary of the run draws its asks on it.

    ``expect(n)`` raises the expected total to ``n`` more queries than asked so far (the schedule's
    promised count); each :meth:`stage` names the stage in the task's description and, if its
    queries go beyond the expected total, raises the total to cover them.
    """

    def __init__(self):
        self._bar = None
        self._task = None

    def __enter__(self) -> "RunProgress":
        self._bar = _bar()
        self._bar.__enter__()
        self._task = self._bar.add_task("starting", total=None)
        return self

    def __exit__(self, *exc):
        self._bar.__exit__(*exc)
        return False

    def _counts(self) -> tuple[float, float | None]:
        task = self._bar.tasks[0]
        return task.completed, task.total

    def expect(self, queries: int) -> None:
        completed, total = self._counts()
        self._bar.update(self._task, total=max(total or 0, completed + queries))

    def note(self, description: str) -> None:
        """Name work between asks (a learner's long step) in the task's description."""
        self._bar.update(self._task, description=description)

    @contextlib.contextmanager
    def stage(self, description: str, total: int, completed: int = 0):
        done, expected = self._counts()
        self._bar.update(self._task, description=description, advance=completed,
                         total=max(expected or 0, done + total))
        yield lambda n: self._bar.advance(self._task, n)


def progress_bar(progress, description: str, total: int, completed: int = 0):
    """The context manager a boundary's ask draws on: the run's bar when ``progress`` is a
    :class:`RunProgress`, else a standalone bar shown as :func:`shown` says."""
    if isinstance(progress, RunProgress):
        return progress.stage(description, total, completed)
    return ProgressBar(shown(progress), description, total, completed)


def note_progress(progress, description: str) -> None:
    """Show ``description`` on the run's bar (if ``progress`` is one): work that asks nothing."""
    if isinstance(progress, RunProgress):
        progress.note(description)


def expect_queries(progress, queries: int) -> None:
    """Tell the run's bar (if ``progress`` is one) to expect ``queries`` more queries."""
    if isinstance(progress, RunProgress):
        progress.expect(queries)


def one_bar_per_run(function):
    """Decorator for a function with a ``progress=`` argument (True, False or None: when stderr is a
    terminal): while it runs, ``progress`` is a :class:`RunProgress` drawn on stderr, or False."""
    signature = inspect.signature(function)

    @functools.wraps(function)
    def wrapper(*args, **kwargs):
        bound = signature.bind(*args, **kwargs)
        progress = bound.arguments.get("progress", signature.parameters["progress"].default)
        if isinstance(progress, RunProgress) or not shown(progress):
            bound.arguments["progress"] = progress if isinstance(progress, RunProgress) else False
            return function(*bound.args, **bound.kwargs)
        with RunProgress() as bar:
            bound.arguments["progress"] = bar
            return function(*bound.args, **bound.kwargs)
    return wrapper
