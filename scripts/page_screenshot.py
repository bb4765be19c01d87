"""Take the README's screenshot of the page (docs/page.png) from a real run.

Starts the service on models/ (faces and shapes) on a free port, opens the page in Chromium, asks
faces about scikit-image's astronaut, unloads shapes and loads it again so that the chart shows a
worker going and coming back, and saves the page. Needs Chromium (/usr/bin/chromium, or
DETECT_TEST_CHROMIUM) and the test extra (Playwright, scikit-image).

    .venv/bin/python scripts/page_screenshot.py [--out docs/page.png]
"""

from __future__ import annotations

import argparse
import io
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CHROMIUM = os.environ.get("DETECT_TEST_CHROMIUM") or shutil.which("chromium") or "/usr/bin/chromium"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "page.png")
    args = parser.parse_args()

    import skimage.data
    from PIL import Image
    from playwright.sync_api import sync_playwright

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    env = {k: v for k, v in os.environ.items() if not k.startswith("DETECT_")}
    env.update(DETECT_PORT=str(port), DETECT_MODEL_REPOSITORY=str(ROOT / "models"), TF_CPP_MIN_LOG_LEVEL="2")
    with tempfile.TemporaryDirectory() as scratch:
        photo = Path(scratch) / "astronaut.jpg"
        buffer = io.BytesIO()
        Image.fromarray(skimage.data.astronaut()).save(buffer, "JPEG", quality=95)
        photo.write_bytes(buffer.getvalue())
        server = subprocess.Popen([sys.executable, "-m", "app", "serve"], cwd=ROOT, env=env,
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            _wait_ready(port)
            print(f"serving on port {port}; opening the page", flush=True)
            with sync_playwright() as playwright:
                browser = playwright.chromium.launch(
                    executable_path=CHROMIUM, headless=True,
                    args=["--no-sandbox", "--disable-gpu", "--disable-background-networking",
                          "--disable-component-update", "--no-first-run"])
                page = browser.new_page(viewport={"width": 1400, "height": 960})
                page.goto(f"http://127.0.0.1:{port}/")
                page.wait_for_selector('#models-body tr[data-state="ready"]')
                page.select_option("#window", "60")
                time.sleep(8)
                page.select_option("#model", "faces")
                page.set_input_files("#file", str(photo))
                page.wait_for_selector("#boxes .box", timeout=60_000)
                print("faces answered; unloading shapes", flush=True)
                time.sleep(6)
                page.locator('#models-body tr[data-model="shapes"] button').click()
                page.wait_for_selector('#models-body tr[data-model="shapes"][data-state="unloaded"]')
                time.sleep(10)
                print("loading shapes again", flush=True)
                page.locator('#models-body tr[data-model="shapes"] button').click()
                page.wait_for_selector('#models-body tr[data-model="shapes"][data-state="ready"]', timeout=60_000)
                time.sleep(8)
                args.out.parent.mkdir(parents=True, exist_ok=True)
                page.screenshot(path=str(args.out), full_page=True)
                browser.close()
        finally:
            server.terminate()
            server.wait(timeout=60)
    print(f"wrote {args.out}")
    return 0


def _wait_ready(port: int, timeout_s: float = 180.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=2) as answer:
                if answer.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise SystemExit(f"the service did not become ready on port {port} in {timeout_s:.0f} s")


if __name__ == "__main__":
    sys.exit(main())
