"""The panel on a live session in a real JupyterLab, in headless Debian Chromium driven by Playwright.

A notebook (written here, so it always matches the code) shows `interactive_parallel.panel()`
with no session. The browser then presses every button the way a workshop would: Start (2
ranks), Doctor, Load (tiny-llama), Apply (pp=2, so every view has something to draw), Train,
a longer Train stopped with Stop while the figures update, Generate, Verify, Save, Load,
Export, Serve, Quantize and Full precision, opens every tab, loads a mixture of experts from a
directory holding its config (the ep control appears beside the degrees), trains it under
dp2 x ep2 with the experts tab following, and finally stops the ranks from the Cluster section. Each result is checked in the DOM, the error area stays empty, and no
tab label or figure title shown is cut at its edge, in the light theme and the dark. Screenshots of the panel in JupyterLab's
light and dark themes go to artifacts/panel-light.png and panel-dark.png (a failure's to
artifacts/panel-failure.png). Helpers: tests/lab_harness.py.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
import time
from pathlib import Path

import pytest
from lab_harness import ARGS, CHROMIUM, Lab, notebook_json, output_text, run_command, set_int, set_theme

from conftest import assert_gone
from interactive_parallel.widgets.views import tab_title

pytestmark = pytest.mark.browser

ARTIFACTS = Path(__file__).resolve().parents[1] / "artifacts"
NOTEBOOK = "panel_smoke.ipynb"
CELLS = [
    "import json\nimport interactive_parallel as ip\np = ip.panel()\np",
    "print('PANEL-' + 'READY')",
    # After Start: the pool's processes, so the test can check they are gone after Stop.
    "pool = p.session.ranks.pool\nprint('POOL-PIDS', json.dumps(pool.process_tree() + [pool._leash.pid]))",
    # Training ran as a task on the kernel's loop (cells and the Stop button stay served), not a thread.
    "job = p.jobs.job\n"
    "print('JOB-MODE', 'none' if job is None else 'task' if job.task is not None else 'thread')\n"
    "if p.session is not None:\n    p.session.stop()\n"
    "print('SESSION-' + 'STOPPED')",
]
PLAN = {"dp": 1, "pp": 2, "microbatches": 2}
TABS = {  # tab -> what its figures draw once the ranks trained under PLAN
    "loss": [".ip-loss-figure .scatterlayer .trace"],
    "memory": [".ip-memory-figure .barlayer .trace"],
    "communication": [".ip-comm-breakdown-figure .barlayer .trace", ".ip-timeline-figure .barlayer .trace"],
    "layout": [".ip-sharding-figure .scatterlayer .trace"],
    "pipeline": [".ip-pipeline-figure .barlayer .trace"],
    "decoding": [".ip-tokens-per-step-figure .barlayer .trace", ".ip-kv-memory-figure .scatterlayer .trace"],
    "requests": [".ip-request-timeline-figure .barlayer .trace"],
    "quantization": [".ip-quantization-figure .barlayer .trace"],
}
MOE = dict(model_type="mixtral", vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
           num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=4, num_experts_per_tok=2,
           max_position_embeddings=256, pad_token_id=0, bos_token_id=1, eos_token_id=2)
MOE_PLAN = {"pp": 1, "microbatches": 0, "dp": 2, "ep": 2}
"""The last phase: a mixture of experts loaded from a directory holding its config, under dp2 x ep2."""
SHOWN_LAST = "communication"
"""The tab open for the screenshots (the busiest page)."""


def test_every_button_of_the_panel_on_a_live_session():
    if not os.path.exists(CHROMIUM):
        pytest.skip(f"{CHROMIUM} is missing: apt-get install -y chromium")
    sync_api = pytest.importorskip("playwright.sync_api", reason="the playwright Python package is not installed")
    expect = sync_api.expect
    t0 = time.monotonic()
    ARTIFACTS.mkdir(exist_ok=True)
    shots = {theme: ARTIFACTS / f"panel-{theme}.png" for theme in ("light", "dark")}
    root = Path(tempfile.mkdtemp(prefix="ip-lab-"))
    (root / NOTEBOOK).write_text(json.dumps(notebook_json(CELLS)))
    moe_dir = root / "tiny-mixtral"
    moe_dir.mkdir()
    (moe_dir / "config.json").write_text(json.dumps(MOE))
    lab = Lab(root)
    pool_pids: list[int] = []
    stop_error: Exception | None = None
    job_mode = ""
    timings: dict[str, float] = {}

    def mark(what: str) -> None:
        timings[what] = round(time.monotonic() - t0, 1)

    try:
        lab.wait_ready()
        with sync_api.sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path=CHROMIUM, args=ARGS)
            page = browser.new_page(viewport={"width": 1600, "height": 2000})
            panel = page.locator(".ip-panel")
            errors = panel.locator(".ip-error-output")
            status = panel.locator(".ip-run-status")

            def click(cls: str) -> None:
                panel.locator(f".{cls}").click()

            def no_error() -> None:
                expect(errors).to_have_text("", timeout=1_000)

            try:
                page.goto(lab.url(f"/lab/tree/{NOTEBOOK}"))
                page.locator(".jp-Notebook .jp-Cell").nth(len(CELLS) - 1).wait_for(timeout=30_000)
                page.locator(".jp-Notebook-ExecutionIndicator[data-status='idle']").wait_for(timeout=30_000)
                page.wait_for_function("() => window.jupyterapp && window.jupyterapp.shell.currentWidget"
                                       " && window.jupyterapp.shell.currentWidget.sessionContext?.session?.kernel")
                run_command(page, "notebook:run-all-above", 2)
                output_text(page, "PANEL-READY", 90_000)
                panel.wait_for(timeout=30_000)
                mark("panel shown")

                set_int(panel, "ip-ranks", 2)
                click("ip-start-button")
                expect(panel.locator(".ip-rank-status")).to_contain_text("rank 1", timeout=120_000)
                no_error()
                run_command(page, "notebook:run-cell", 2)
                text = output_text(page, "POOL-PIDS", 30_000)
                pool_pids = json.loads(text.split("POOL-PIDS", 1)[1].strip().splitlines()[0])
                mark("started")

                click("ip-doctor-button")
                expect(panel.locator(".ip-doctor-output")).to_contain_text("every rank met", timeout=60_000)
                click("ip-load-model-button")
                messages = panel.locator(".ip-plan-messages")
                expect(messages).to_contain_text("(loaded)", timeout=60_000)
                for name, value in PLAN.items():
                    set_int(panel, f"ip-{name}", value)
                expect(messages).to_contain_text("fits 2 ranks", timeout=10_000)
                click("ip-apply-button")
                expect(messages).to_contain_text("applied", timeout=60_000)
                no_error()
                mark("applied")

                set_int(panel, "ip-train-steps", 3)
                click("ip-train-button")
                expect(status).to_contain_text("done: 3 steps", timeout=90_000)
                wait_js(page, f"({LOSS_POINTS_JS})() === 3", LOSS_POINTS_JS, 15_000)
                no_error()
                mark("trained 3")

                # A longer run, stopped: the figures follow the steps while it runs (the pipeline
                # tab's title names the step it draws), and Stop ends it early without an error.
                open_tab(panel, "pipeline")
                title = panel.locator(".ip-pipeline-figure .gtitle")
                expect(title).to_contain_text("bubble", timeout=30_000)
                drawn = drawn_step(page)
                set_int(panel, "ip-train-steps", 300)
                click("ip-train-button")
                wait_js(page, f"({DRAWN_STEP_JS})() > {drawn}", DRAWN_STEP_JS, 60_000)
                open_tab(panel, "loss")  # drawn whole, then grows
                wait_js(page, f"({LOSS_POINTS_JS})() >= 6", LOSS_POINTS_JS, 60_000)
                wait_js(page, f"({LOSS_POINTS_JS})() > {page.evaluate(LOSS_POINTS_JS)}", LOSS_POINTS_JS, 60_000)
                expect(panel.locator(".ip-train-button")).to_be_disabled()  # still training meanwhile
                click("ip-interrupt-button")
                expect(status).to_contain_text("stopped after", timeout=60_000)
                done = int(re.search(r"stopped after (\d+) of 300", status.text_content()).group(1))
                assert 3 <= done < 300, status.text_content()
                expect(panel.locator(".ip-train-button")).to_be_enabled()
                no_error()
                mark("stopped")

                prompts = panel.locator(".ip-prompts textarea")
                prompts.fill("12+35=")
                prompts.blur()
                set_int(panel, "ip-max-tokens", 6)
                click("ip-generate-button")
                expect(status).to_contain_text("generated", timeout=60_000)
                generated = panel.locator(".ip-generate-output .ip-generated")
                expect(generated).to_have_count(1)
                assert generated.text_content().startswith("12+35=") and len(generated.text_content()) > 6
                click("ip-verify-button")
                verify = panel.locator(".ip-verify-output")
                expect(verify).to_contain_text("OK", timeout=60_000)
                assert verify.locator("tr").count() > 10  # a row per parameter
                click("ip-save-button")
                files = panel.locator(".ip-files-output")
                expect(files).to_contain_text("saved checkpoint", timeout=60_000)
                click("ip-load-checkpoint-button")
                expect(files).to_contain_text("loaded checkpoint", timeout=60_000)
                click("ip-export-button")
                expect(files).to_contain_text("wrote script", timeout=30_000)
                set_int(panel, "ip-serve-count", 4)
                click("ip-serve-button")
                expect(status).to_contain_text("served 4 requests", timeout=60_000)
                expect(panel.locator(".ip-serve-output")).to_contain_text("done (", timeout=10_000)
                click("ip-quantize-button")
                quantized = panel.locator(".ip-quantize-output")
                expect(quantized).to_contain_text("int8-weight-only", timeout=60_000)
                click("ip-dequantize-button")
                expect(quantized).to_contain_text("full precision", timeout=60_000)
                click("ip-quantize-button")  # left quantized, so the quantization tab has bars to draw
                expect(quantized).to_contain_text("int8-weight-only", timeout=60_000)
                no_error()
                mark("every button")

                for tab, selectors in [*TABS.items(), (SHOWN_LAST, TABS[SHOWN_LAST])]:
                    open_tab(panel, tab)
                    for selector in selectors:
                        expect(panel.locator(selector).first).to_be_visible(timeout=30_000)
                    expect(panel.locator(f".ip-{tab}-message")).not_to_contain_text("failed")
                    nothing_cut(page)
                no_error()
                mark("every tab")

                panel.screenshot(path=str(shots["light"]))
                set_theme(page, "JupyterLab Dark")
                check_dark(page)
                nothing_cut(page)
                panel.screenshot(path=str(shots["dark"]))
                set_theme(page, "JupyterLab Light")
                mark("screenshots")

                # A mixture of experts from a config directory: the ep control shows beside the
                # degrees, and the experts tab follows the steps under dp2 x ep2.
                expect(panel.locator(".ip-ep")).to_be_hidden()
                panel.locator(".ip-model-path input").fill(str(moe_dir))
                click("ip-load-model-button")
                expect(messages).to_contain_text("(loaded)", timeout=120_000)
                expect(panel.locator(".ip-ep")).to_be_visible(timeout=10_000)
                for name, value in MOE_PLAN.items():
                    set_int(panel, f"ip-{name}", value)
                expect(messages).to_contain_text("fits 2 ranks", timeout=10_000)
                click("ip-apply-button")
                expect(messages).to_contain_text("applied", timeout=60_000)
                open_tab(panel, "experts")
                set_int(panel, "ip-train-steps", 2)
                click("ip-train-button")
                expect(status).to_contain_text("done: 2 steps", timeout=90_000)
                load_title = panel.locator(".ip-expert-load-figure .gtitle")
                expect(load_title).to_contain_text("step 1", timeout=30_000)
                expect(load_title).to_contain_text("imbalance max/mean")
                expect(panel.locator(".ip-expert-load-figure .heatmaplayer").first).to_be_visible()
                expect(panel.locator(".ip-tokens-moved-figure .heatmaplayer").first).to_be_visible()
                nothing_cut(page)
                no_error()
                mark("experts")

                click("ip-stop-cluster-button")
                expect(panel.locator(".ip-rank-status")).to_contain_text("no session", timeout=60_000)
                no_error()
            except BaseException:
                try:  # what the panel said is usually the cause
                    print("panel error area:", errors.first.text_content(timeout=2_000))
                except Exception:  # noqa: BLE001
                    pass
                failure = ARTIFACTS / "panel-failure.png"
                try:
                    (panel if panel.count() else page).screenshot(path=str(failure))
                except Exception:  # noqa: BLE001 - keep the original failure
                    page.screenshot(path=str(failure))
                raise
            finally:
                try:  # the last cell stops the session, pass or fail
                    run_command(page, "notebook:run-cell", len(CELLS) - 1)
                    job_mode = output_text(page, "JOB-MODE", 60_000)
                    output_text(page, "SESSION-STOPPED", 60_000)
                except Exception as exc:  # noqa: BLE001 - raised below unless a failure is already on its way
                    stop_error = exc
                finally:
                    browser.close()
    finally:
        lab.stop()
        shutil.rmtree(root, ignore_errors=True)
    print("timings (s since start):", timings, f"total {time.monotonic() - t0:.1f}")
    if stop_error is not None:
        raise stop_error
    assert "JOB-MODE task" in job_mode, job_mode
    assert pool_pids, "the notebook never printed its pool's processes"
    assert_gone(pool_pids, [])
    assert all(p.exists() for p in shots.values())


DRAWN_STEP_JS = """() => {
    const title = document.querySelector('.ip-pipeline-figure .gtitle');
    const m = title && title.textContent.match(/step (\\d+)/);
    return m ? Number(m[1]) : -1;
}"""


LOSS_POINTS_JS = """() => {
    const trace = document.querySelector('.ip-loss-figure .scatterlayer .trace');
    return trace ? trace.querySelectorAll('.points path').length : 0;
}"""


CUT_JS = """() => {
    const cut = [];
    document.querySelectorAll('.ip-panel .ip-views > .lm-TabBar .lm-TabBar-tab').forEach((tab) => {
        const label = tab.querySelector('.lm-TabBar-tabLabel') || tab;
        const bar = tab.parentElement.parentElement.getBoundingClientRect();
        const box = tab.getBoundingClientRect();
        if (label.scrollWidth > label.clientWidth + 1 || box.right > bar.right + 1) cut.push('tab ' + label.textContent);
    });
    document.querySelectorAll('.ip-panel .ip-figure').forEach((figure) => {
        const title = figure.querySelector('.gtitle');
        const svg = figure.querySelector('.main-svg');
        const frame = figure.getBoundingClientRect();
        if (!title || !svg || frame.width === 0) return;  // a closed tab's figure
        const right = Math.min(frame.right, svg.getBoundingClientRect().right);
        const box = title.getBoundingClientRect();
        if (box.left < frame.left - 1 || box.right > right + 1) cut.push('title ' + title.textContent);
    });
    return cut;
}"""


def open_tab(panel, name: str) -> None:
    panel.locator(".ip-views .lm-TabBar-tab", has_text=tab_title(name)).click()


def nothing_cut(page) -> None:
    """No tab label and no title of a figure shown is cut at its edge (the figures are fitted to
    their column a moment after a tab opens, hence the wait)."""
    wait_js(page, f"({CUT_JS})().length === 0", CUT_JS, 15_000)


def wait_js(page, condition: str, probe: str, timeout_ms: int) -> None:
    """Wait until the JS expression `condition` holds; a timeout says what `probe` read instead."""
    try:
        page.wait_for_function(f"() => {condition}", timeout=timeout_ms)
    except Exception as exc:
        raise AssertionError(f"never held: {condition}; the probe read {page.evaluate(probe)!r}") from exc


def drawn_step(page) -> int:
    """The step the pipeline figure shows (its title names it)."""
    return page.evaluate(DRAWN_STEP_JS)


def check_dark(page) -> None:
    """In the dark theme the panel's text is light and the figures are drawn inverted (render.STYLE)."""
    colour = page.evaluate("() => getComputedStyle(document.querySelector('.ip-panel')).color")
    r, g, b = (int(x) for x in re.findall(r"\d+", colour)[:3])
    assert (r + g + b) / 3 > 150, f"panel text {colour} is dark on the dark theme"
    svg_filter = page.evaluate("() => getComputedStyle(document.querySelector('.ip-loss-figure .main-svg')).filter")
    assert "invert" in svg_filter, svg_filter
