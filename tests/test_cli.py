"""The headless demo writes a standalone HTML report with the loss figure, and asks the model
additions before and after training, with the sums beside its answers and how many it got right."""
import pytest

from interactive_parallel.cli import main

pytestmark = pytest.mark.session


def test_demo_writes_report_with_loss_figure(tmp_path, capsys, monkeypatch):
    from interactive_parallel.cluster import offline

    monkeypatch.setattr(offline, "usable_cores", lambda: 2)  # the default: a rank per core, dp over them
    report = tmp_path / "report.html"
    assert main(["demo", "--steps", "4", "--seq-len", "32", "--report", str(report)]) == 0
    html = report.read_text()
    assert 'id="loss"' in html and "plotly" in html.lower()
    out = capsys.readouterr().out
    assert "2 ranks ready" in out and "report written" in out and "laid out as dp2" in out
    assert "right: " in out and " of 8 after 4 steps (before training: " in out  # --quiz 8 additions
    assert "docs/index.md" in out and "notebooks/00_tour.ipynb" in out  # what to open next


def test_demo_refuses_a_bad_plan_before_starting(capsys):
    assert main(["demo", "--ranks", "2", "--plan", "dp=3"]) == 2
    assert "!= ranks(2)" in capsys.readouterr().err
