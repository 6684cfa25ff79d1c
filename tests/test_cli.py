"""The headless demo writes a standalone HTML report with the loss figure."""
import pytest

from interactive_parallel.cli import main

pytestmark = pytest.mark.session


def test_demo_writes_report_with_loss_figure(tmp_path, capsys):
    report = tmp_path / "report.html"
    assert main(["demo", "--ranks", "2", "--plan", "dp=2", "--steps", "4", "--seq-len", "32",
                 "--report", str(report)]) == 0
    html = report.read_text()
    assert 'id="loss"' in html and "plotly" in html.lower()
    out = capsys.readouterr().out
    assert "2 ranks ready" in out and "report written" in out


def test_demo_refuses_a_bad_plan_before_starting(capsys):
    assert main(["demo", "--ranks", "2", "--plan", "dp=3"]) == 2
    assert "!= ranks(2)" in capsys.readouterr().err
