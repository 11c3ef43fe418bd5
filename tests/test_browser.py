"""Notebook 06's widgets in a real browser: JupyterLab + headless Chromium, driven as a person would.

Starts JupyterLab on a free loopback port with a random token on a temporary copy of notebooks/
(so nothing committed is saved over), opens notebook 06, runs all cells from the Run menu, moves
the padding and the batch-size sliders with the keyboard, and checks that the readouts, the status
line (the benchmark reran) and the plot changed. Screenshots: build/browser/before.png, after.png.

Uses Debian's chromium (``apt-get install chromium``) through the playwright package; it never
downloads a browser. Skips, saying why, where either is missing.
"""

import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SHOTS = ROOT / "build" / "browser"
CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync"]
NOTEBOOK = "06_padding_sparsity.ipynb"

pytestmark = pytest.mark.slow


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _processes_mentioning(text: str) -> list[int]:
    """PIDs whose command line contains ``text`` (a path unique to this test: its kernels' runtime dir)."""
    pids = []
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and text in (proc / "cmdline").read_bytes().decode(errors="replace"):
                pids.append(int(proc.name))
        except OSError:
            pass
    return pids


@pytest.fixture
def lab(tmp_path):
    """A JupyterLab server of its own (config, runtime and workspace dirs under tmp_path); stopped by PID afterwards."""
    if not Path(CHROMIUM).exists():
        pytest.skip("no chromium: install Debian's (apt-get install chromium) to run the browser test")
    pytest.importorskip("playwright.sync_api", reason="the playwright package is missing (pip install -e '.[dev]')")
    root = tmp_path / "notebooks"
    shutil.copytree(ROOT / "notebooks", root, ignore=shutil.ignore_patterns(".ipynb_checkpoints"))
    runtime = tmp_path / "runtime"
    news = tmp_path / "config" / "lab" / "user-settings" / "@jupyterlab" / "apputils-extension"
    news.mkdir(parents=True)  # answer JupyterLab's "get notified about Jupyter news?" toast with No, up front
    (news / "notification.jupyterlab-settings").write_text('{"fetchNews": "false", "checkForUpdates": false}')
    port, token = _free_port(), secrets.token_urlsafe(24)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("JUPYTER", "BTLIB_"))}
    env.update(BTLIB_QUICK="1", JUPYTER_CONFIG_DIR=str(tmp_path / "config"), JUPYTER_DATA_DIR=str(tmp_path / "data"),
               JUPYTER_RUNTIME_DIR=str(runtime), MPLCONFIGDIR=str(tmp_path / "mpl"))
    cmd = [sys.executable, "-m", "jupyterlab", "--no-browser", "--ip=127.0.0.1", f"--port={port}", "--port-retries=0",
           f"--IdentityProvider.token={token}", f"--ServerApp.root_dir={root}", "--LabApp.news_url=None",
           f"--LabApp.workspaces_dir={tmp_path / 'workspaces'}"]
    if os.geteuid() == 0:
        cmd.append("--allow-root")
    log = open(tmp_path / "lab.log", "w")
    server = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 90
        while True:
            assert server.poll() is None, f"jupyter lab exited: {(tmp_path / 'lab.log').read_text()[-2000:]}"
            try:
                urllib.request.urlopen(f"{url}/api/status?token={token}", timeout=2)
                break
            except OSError:
                assert time.time() < deadline, f"jupyter lab did not answer: {(tmp_path / 'lab.log').read_text()[-2000:]}"
                time.sleep(0.5)
        yield url, token
    finally:
        server.send_signal(signal.SIGTERM)  # the server shuts its kernels down on SIGTERM
        try:
            server.wait(timeout=20)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
        log.close()
        left = _processes_mentioning(str(runtime))
        for pid in left:
            os.kill(pid, signal.SIGKILL)
        assert not left, f"kernel processes outlived the server: {left}"


def _wait(page, predicate, what: str, timeout: float = 120.0, every: float = 0.25):
    """Poll ``predicate(page)`` until it is truthy; fail saying ``what`` was awaited."""
    deadline = time.time() + timeout
    while True:
        value = predicate(page)
        if value:
            return value
        if time.time() > deadline:
            page.screenshot(path=str(SHOTS / "timeout.png"))
            raise AssertionError(f"timed out waiting for {what} (screenshot: build/browser/timeout.png)")
        time.sleep(every)


def _kernel_idle(page) -> bool:
    return page.locator(".jp-StatusBar-TextItem", has_text=re.compile(r"\|\s*Idle")).count() > 0


def _all_cells_ran(page) -> bool:
    """A fresh kernel numbers Run All's cells 1..n: done when every prompt (scrolled out of view too) shows its number."""
    prompts = [p.strip() for p in page.locator(".jp-Notebook .jp-CodeCell .jp-InputPrompt").all_text_contents()]
    return prompts == [f"[{i}]:" for i in range(1, len(prompts) + 1)] and _kernel_idle(page)


def _explorer_state(ui) -> dict:
    """What a person sees of the PaddingExplorer: slider readouts, status line, and the plot image."""
    img = ui.locator(".jp-OutputArea-output img")
    return {
        "readouts": ui.locator(".widget-hslider .widget-readout").all_inner_texts(),
        "status": ui.locator(".widget-label").last.inner_text(),
        "plot": img.first.get_attribute("src") if img.count() else None,
    }


def _move_slider(page, ui, index: int, before: dict) -> dict:
    """Focus slider ``index`` by clicking its handle and press ArrowRight once; wait until the rerun has drawn."""
    ui.locator(".widget-hslider .noUi-handle").nth(index).click()
    page.keyboard.press("ArrowRight")

    def redrawn(_page):
        now = _explorer_state(ui)
        return now if now["plot"] and now["plot"] != before["plot"] and now["status"] != before["status"] else None

    return _wait(page, redrawn, f"the rerun after moving slider {index}", timeout=60)


def test_padding_explorer_in_jupyterlab(lab):
    from playwright.sync_api import sync_playwright

    url, token = lab
    SHOTS.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            page.goto(f"{url}/lab/tree/{NOTEBOOK}?token={token}")
            _wait(page, _kernel_idle, "the kernel's Idle in the status bar")
            page.get_by_role("menuitem", name="Run", exact=True).click()
            page.get_by_role("menuitem", name="Run All Cells", exact=True).click()
            queued = page.locator(".jp-Notebook .jp-InputPrompt", has_text="[*]")  # committed prompts look finished too
            _wait(page, lambda p: queued.count() > 0, "Run All to queue the cells", timeout=30, every=0.1)
            _wait(page, _all_cells_ran, "every cell to finish", timeout=300, every=1.0)
            errors = page.locator('[data-mime-type="application/vnd.jupyter.error"]')
            assert errors.count() == 0, errors.all_inner_texts()

            ui = page.locator(".jp-Cell", has=page.locator(".widget-hslider")).last
            ui.locator(".widget-hslider").first.scroll_into_view_if_needed()
            before = _wait(page, lambda p: (s := _explorer_state(ui))["plot"] and s, "the explorer's first plot")
            assert before["readouts"][:2] == ["0.50", "4"], before
            ui.scroll_into_view_if_needed()
            page.screenshot(path=str(SHOTS / "before.png"))

            moved = _move_slider(page, ui, 0, before)       # padding 0.50 -> 0.55
            after = _move_slider(page, ui, 1, moved)        # batch size 4 -> 5
            ui.scroll_into_view_if_needed()
            page.screenshot(path=str(SHOTS / "after.png"))

            assert moved["readouts"][0] == "0.55" and after["readouts"][1] == "5", (before, moved, after)
            assert "B=4" in before["status"] and "B=5" in after["status"], (before["status"], after["status"])
            assert len({before["plot"], moved["plot"], after["plot"]}) == 3
            spilled = ui.locator('[data-mime-type="application/vnd.jupyter.stderr"]')
            assert spilled.count() == 0, spilled.all_inner_texts()
        finally:
            browser.close()
    print(f"browser test: {time.time() - t0:.0f} s in the browser")
