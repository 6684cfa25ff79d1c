"""A JupyterLab server and the few browser moves the browser tests make (Playwright, Debian's Chromium).

Owns starting and stopping a throwaway JupyterLab (own process group, temp root, no update
checks, and a browser that reaches nothing outside this machine), and helpers that type into
a widget, run a notebook command, read a cell's output and switch the theme. Knows nothing of
the panel.
"""
from __future__ import annotations

import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

CHROMIUM = "/usr/lib/chromium/chromium"
# Root in a container: no sandbox; no GPU; and nothing that phones home (QUIC, background
# networking, component updates, sync) so a run never waits on a network it cannot reach.
ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
        "--disable-component-update", "--disable-sync", "--disable-dev-shm-usage"]


def notebook_json(cells: list[str]) -> dict:
    return {
        "cells": [{"cell_type": "code", "execution_count": None, "id": f"cell{i}", "metadata": {}, "outputs": [],
                   "source": src} for i, src in enumerate(cells)],
        "metadata": {"kernelspec": {"display_name": "Python 3", "language": "python", "name": "python3"}},
        "nbformat": 4, "nbformat_minor": 5,
    }


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Lab:
    """A JupyterLab server in its own process group, rooted in a temp dir, stopped without trace."""

    def __init__(self, root: Path):
        self.root, self.port, self.token = root, free_port(), secrets.token_hex(16)
        settings = root / ".settings"
        notify = settings / "@jupyterlab" / "apputils-extension"
        notify.mkdir(parents=True)
        (notify / "notification.jupyterlab-settings").write_text(
            json.dumps({"fetchNews": "false", "checkForUpdates": False}))
        env = dict(os.environ, JUPYTERLAB_SETTINGS_DIR=str(settings),
                   JUPYTERLAB_WORKSPACES_DIR=str(root / ".workspaces"), JUPYTER_RUNTIME_DIR=str(root / ".runtime"),
                   TRANSFORMERS_VERBOSITY="error", HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1")
        cmd = [sys.executable, "-m", "jupyterlab", "--no-browser", "--ip=127.0.0.1", f"--port={self.port}",
               "--ServerApp.port_retries=0", f"--ServerApp.token={self.token}", f"--ServerApp.root_dir={root}",
               "--LabApp.news_url=None", "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate",
               "--LabApp.extension_manager=readonly", "--LabApp.expose_app_in_browser=True"]
        if hasattr(os, "geteuid") and os.geteuid() == 0:
            cmd.append("--allow-root")
        self.log = open(root / "lab.log", "wb")
        self.proc = subprocess.Popen(cmd, cwd=root, env=env, stdout=self.log, stderr=subprocess.STDOUT,
                                     start_new_session=True)

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.port}{path}?token={self.token}"

    def wait_ready(self, timeout: float = 30) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"jupyter lab exited: {(self.root / 'lab.log').read_text()[-2000:]}")
            try:
                with urllib.request.urlopen(self.url("/api/status"), timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                time.sleep(0.3)
        raise TimeoutError("jupyter lab did not answer /api/status")

    def stop(self) -> None:
        try:
            req = urllib.request.Request(self.url("/api/shutdown"), method="POST")
            urllib.request.urlopen(req, timeout=5).close()
            self.proc.wait(15)
        except Exception:  # noqa: BLE001 - the kill below is the fallback
            pass
        finally:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait(10)
            self.log.close()


def output_text(page, marker: str, timeout_ms: int):
    """The text of the output holding `marker` (not the cell source, which contains it too)."""
    loc = page.locator(".jp-OutputArea-output", has_text=marker).first
    loc.wait_for(timeout=timeout_ms)
    return loc.text_content()


def set_int(panel, cls: str, value: int) -> None:
    box = panel.locator(f".{cls} input")
    box.fill(str(value))
    box.press("Enter")  # IntText syncs on Enter or blur


def run_command(page, command: str, cell_index: int) -> None:
    page.evaluate("""([command, index]) => {
        const nb = window.jupyterapp.shell.currentWidget.content;
        nb.activeCellIndex = index;
        return window.jupyterapp.commands.execute(command);
    }""", [command, cell_index])


def set_theme(page, name: str) -> None:
    """Switch JupyterLab's theme ('JupyterLab Light' / 'JupyterLab Dark') and wait until it applies."""
    light = "true" if "Light" in name else "false"
    page.evaluate("(theme) => window.jupyterapp.commands.execute('apputils:change-theme', {theme})", name)
    page.locator(f"body[data-jp-theme-light='{light}']").wait_for(state="attached", timeout=30_000)
    page.wait_for_timeout(500)  # the theme's stylesheet replaces the old one after the attribute flips
