"""Take the screenshot of the page that the README and the docs show (docs/page.png) from a real run.

Starts the service on models/ (faces and shapes) on a free port, opens the page in Chromium, asks
faces about scikit-image's astronaut, unloads shapes and loads it again so that the chart shows a
worker going and coming back, and saves the page. Needs Chromium (/usr/bin/chromium, or
DETECT_TEST_CHROMIUM) and the test extra (Playwright, scikit-image).

    .venv/bin/python -m tools.page_screenshot [--out docs/page.png]
"""

from __future__ import annotations

import argparse
import io
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

from tools import ROOT
from tools.server import ServerProcess

CHROMIUM = os.environ.get("DETECT_TEST_CHROMIUM") or shutil.which("chromium") or "/usr/bin/chromium"


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.page_screenshot", description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "page.png")
    args = parser.parse_args()

    import skimage.data
    from PIL import Image
    from playwright.sync_api import sync_playwright

    with tempfile.TemporaryDirectory() as scratch:
        photo = Path(scratch) / "astronaut.jpg"
        buffer = io.BytesIO()
        Image.fromarray(skimage.data.astronaut()).save(buffer, "JPEG", quality=95)
        photo.write_bytes(buffer.getvalue())
        # the shipped settings, as scripts/run serves them: models/ with its per-model caps
        server = ServerProcess.start(ROOT / "config" / "default.toml", Path(scratch) / "server.log")
        port = server.port
        try:
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
            server.stop()
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
