"""The progress bar: one per extract() run, on stderr, naming its stages; silent when stderr is not
a terminal unless progress=True."""

import mhaextract as mx
from mhaextract.oracle import progress as progress_module


def _run(**options):
    target = mx.MultiHeadAttention.random(4, 2, seed=0)
    return mx.extract(mx.SimulatedOracle(target), 4, heads=2, seed=0, **options)


def test_a_redirected_run_draws_nothing(capsys):
    result = _run()  # stderr is pytest's capture here: not a terminal
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err == ""
    assert result.ok


def test_progress_true_draws_one_bar_on_stderr_naming_every_stage(monkeypatch, capsys):
    bars, stages = [], []
    make_bar, stage = progress_module._bar, progress_module.RunProgress.stage

    def counted_bar():
        bar = make_bar()
        bars.append(bar)
        return bar

    def recorded(self, description, total, completed=0):
        stages.append((description, total))
        return stage(self, description, total, completed)

    monkeypatch.setattr(progress_module, "_bar", counted_bar)
    monkeypatch.setattr(progress_module.RunProgress, "stage", recorded)
    result = _run(progress=True)
    assert len(bars) == 1  # one Progress for the whole run, calibration included
    assert bars[0].console.stderr
    assert capsys.readouterr().out == ""
    names = [description for description, _ in stages]
    assert any(name.startswith("calibration") for name in names)
    assert any("phase 1" in name for name in names) and any("final instances" in name for name in names)
    # every query of the run went through the one bar, and its expected total covers them
    task = bars[0].tasks[0]
    assert task.completed == result.queries and task.total >= result.queries


def test_a_standalone_boundary_bar_draws_on_stderr(monkeypatch):
    consoles = []
    make_bar = progress_module._bar
    monkeypatch.setattr(progress_module, "_bar", lambda: consoles.append(make_bar()) or consoles[-1])
    with progress_module.progress_bar(True, "probes", 3) as advance:
        advance(3)
    assert len(consoles) == 1 and consoles[0].console.stderr


def test_progress_is_documented():
    doc = mx.extract.__doc__
    assert "progress :" in doc and "stderr" in doc
