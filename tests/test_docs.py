"""The documentation is built and run, not trusted.

- `mkdocs build --strict` builds the site: a broken link, a missing anchor, a page left out of the navigation
  or a reference generator that fails is an error. The built pages fetch nothing from elsewhere.
- Every block marked `<!-- test: run -->` in README.md and docs/ runs against a real server on the committed
  models, as a reader would run it (curl, the Python examples): each command must succeed (or exit as the
  marker says), and an answer shown under a command must have the same shape as the real one: the same
  keys and types, not the same timings or scores. Option after `run`: `exit=N` (the exit status expected).
  Every example runs in the repository's root, as a reader types it there: the images they send are the
  committed ones in samples/, and this test makes no file for them (tests/test_newcomer.py runs the README's
  and the tutorials' in a fresh clone, in the venv `scripts/run` builds).
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from conftest import ROOT, start_server

from tools.docs import hooks as docs_hooks

PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
MARKER = re.compile(r"^<!-- test: run(?P<options>[^>]*) -->\n```(?P<lang>\w*)\n(?P<body>.*?)^```$",
                    re.MULTILINE | re.DOTALL)
# The pages whose examples a newcomer copies first: each must have runnable blocks.
MUST_RUN = ["README.md", "docs/tutorials/first-detection.md", "docs/reference/detect-api.md",
            "docs/reference/protocols.md", "docs/reference/ops-api.md"]


CONTINUED = ("\\", "|", "&&")  # a command that goes on on the next line


@dataclass
class Step:
    """One command of a block, with the output the page shows under it (console blocks only)."""

    command: str
    shown: str = ""


@dataclass
class Block:
    page: str
    line: int
    lang: str
    body: str
    options: dict = field(default_factory=dict)

    def steps(self) -> list[Step]:
        if self.lang == "console":
            steps: list[Step] = []
            continuing = False
            for line in self.body.splitlines():
                if line.startswith("$ ") and not continuing:
                    steps.append(Step(line[2:]))
                elif continuing:
                    steps[-1].command += "\n" + line
                else:
                    steps[-1].shown += line + "\n"
                continuing = line.endswith(CONTINUED) and not steps[-1].shown
            return steps
        if self.lang == "sh":
            commands, current = [], ""
            for line in self.body.splitlines():
                current += line + "\n"
                if not line.endswith(CONTINUED):
                    if current.strip() and not current.strip().startswith("#"):
                        commands.append(current)
                    current = ""
            return [Step(command) for command in commands]
        raise AssertionError(f"{self.page}:{self.line}: a runnable block must be console, sh or python")


def runnable_blocks(path: Path, root: Path = ROOT) -> list[Block]:
    """The `<!-- test: run -->` blocks of a page, named by its path under `root` (a checkout)."""
    text = path.read_text()
    blocks = []
    for match in MARKER.finditer(text):
        options = dict(item.split("=", 1) for item in match.group("options").split())
        blocks.append(Block(str(path.relative_to(root)), text[:match.start()].count("\n") + 2, match.group("lang"),
                            match.group("body"), options))
    return blocks


ALL_BLOCKS = [block for page in PAGES for block in runnable_blocks(page)]


# Shapes -------------------------------------------------------------------------------------------------------

ANY = "\x00any"  # what `[...]` and `{...}` in a shown answer stand for


def parse_shown(text: str):
    """Parse an answer as the page shows it, `...` standing for whatever the server puts there; None if not JSON."""
    text = text.replace("[...]", json.dumps(ANY)).replace("{...}", json.dumps(ANY))
    text = re.sub(r":\s*\.\.\.(?=\s*[,}])", lambda _: ": " + json.dumps(ANY), text)  # a value: "key": ...
    text = re.sub(r",\s*\.\.\.\s*(?=[\]}])", "", text)
    try:
        return json.loads(text)
    except ValueError:
        return None


def kind(value) -> str:
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, (int, float)):
        return "number"
    return {str: "string", dict: "object", list: "array", type(None): "null"}[type(value)]


def shape_differences(shown, actual, where: str = "answer") -> list[str]:
    """Where `actual` differs in shape from `shown`: keys, types, list items position by position."""
    if shown == ANY:
        return []
    if kind(shown) != kind(actual):
        return [f"{where}: shown {kind(shown)}, got {kind(actual)}"]
    if isinstance(shown, dict):
        if set(shown) != set(actual):
            return [f"{where}: shown keys {sorted(shown)}, got {sorted(actual)}"]
        return [d for key in shown for d in shape_differences(shown[key], actual[key], f"{where}.{key}")]
    if isinstance(shown, list):
        if shown and not actual:
            return [f"{where}: shown {len(shown)} items, got none"]
        return [d for i, (s, a) in enumerate(zip(shown, actual)) for d in shape_differences(s, a, f"{where}[{i}]")]
    return []


def test_shape_differences_ignores_values_but_not_keys_or_types():
    shown = parse_shown('{"a": 1, "b": [{"c": "x"}], "d": [...], "e": {...}}')
    assert shape_differences(shown, {"a": 2.5, "b": [{"c": "y"}, {"c": "z"}], "d": [1], "e": {"f": 1}}) == []
    anything = parse_shown('{"a": ..., "b": {...}, "c": 1}')  # what differs by machine: null on one, a value on another
    assert shape_differences(anything, {"a": None, "b": None, "c": 2}) == []
    assert shape_differences(anything, {"a": 1.5, "b": {"x": 1}, "c": 2}) == []
    assert shape_differences(shown, {"a": "1", "b": [], "d": [], "e": {}}) == [
        "answer.a: shown number, got string", "answer.b: shown 1 items, got none"]
    assert shape_differences(shown, {"a": 1, "b": [{"c": "x", "new": 1}], "d": [], "e": {}}) == [
        "answer.b[0]: shown keys ['c'], got ['c', 'new']"]


def test_the_console_and_sh_parsers_split_commands_and_outputs():
    block = Block("p", 1, "console", "$ a \\\n    b\n{\"x\": 1}\n$ c\n")
    assert [(s.command, s.shown) for s in block.steps()] == [("a \\\n    b", '{"x": 1}\n'), ("c", "")]
    block = Block("p", 1, "sh", "# note\none   # says\ntwo \\\n  three\nfour |\n  five\n\n")
    assert [s.command for s in block.steps()] == ["one   # says\n", "two \\\n  three\n", "four |\n  five\n"]


def test_the_pages_a_newcomer_copies_from_have_runnable_examples():
    pages = {block.page for block in ALL_BLOCKS}
    assert set(MUST_RUN) <= pages, f"no <!-- test: run --> block in {sorted(set(MUST_RUN) - pages)}"


def test_every_route_has_a_curl_example_that_the_tests_run():
    run = "".join(block.body for block in ALL_BLOCKS)
    for route in ("/detect", "/models/shapes/detect", "/detect/video", "/models/shapes/detect/video", "/models/shapes", "/gpu", "/gpu/history", "/healthz", "/readyz",
                  "/metrics", "/v2/repository/index", "/v2/repository/models/shapes/unload", "/v1/models/shapes:predict"):
        assert f"localhost:8000{route}" in run, f"no runnable curl example for {route}"


def test_every_list_starts_after_a_blank_line():
    """MkDocs (Python-Markdown) reads a list that follows a paragraph line as more of the paragraph; GitHub does not."""
    item = re.compile(r"^([-*]|\d+\.) ")
    for page in sorted((ROOT / "docs").rglob("*.md")):
        fenced = False
        previous = ""
        for number, line in enumerate(page.read_text().splitlines(), 1):
            if line.lstrip().startswith("```"):
                fenced = not fenced
            if not fenced and item.match(line) and previous.strip() and not item.match(previous) \
                    and not previous.startswith((" ", "|", "#", "<!--")):
                raise AssertionError(f"{page.relative_to(ROOT)}:{number}: put a blank line before this list")
            previous = line


# The site -----------------------------------------------------------------------------------------------------


def mkdocs() -> list[str]:
    """MkDocs as `python -m mkdocs`, run from the root: the hooks import this checkout's `tools` and `app`."""
    if importlib.util.find_spec("mkdocs") is None:
        pytest.skip("mkdocs is not installed: pip install -e '.[docs]' (scripts/test installs it)")
    return [sys.executable, "-m", "mkdocs"]


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("site")
    result = subprocess.run([*mkdocs(), "build", "--strict", "--site-dir", str(out)], cwd=ROOT, capture_output=True,
                            text=True, timeout=300, env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert result.returncode == 0, result.stdout + result.stderr
    return out


def test_the_site_builds_strictly_with_every_page_in_the_navigation(site):
    assert (site / "index.html").is_file()
    for page in (ROOT / "docs").rglob("*.md"):
        built = site / page.relative_to(ROOT / "docs").with_suffix(".html")
        assert built.is_file(), f"{page} was not built"


def test_the_built_pages_fetch_nothing_from_elsewhere(site):
    """No web font, CDN script or stylesheet, analytics: a page opened offline is whole."""
    external = re.compile(r"""<(?:script|link|img|iframe)\b[^>]*\b(?:src|href)=["'](?:https?:)?//""", re.IGNORECASE)
    for page in site.rglob("*.html"):
        html = page.read_text()
        assert not external.search(html), f"{page.relative_to(site)}: {external.search(html).group(0)}"
        assert "fonts.googleapis" not in html and "googletagmanager" not in html, page
        # Material's script fetches from elsewhere only for a repository link (api.github.com) or a Mermaid
        # diagram (unpkg.com); the site has neither.
        assert 'class="md-source"' not in html and 'class="mermaid"' not in html, page


def test_the_reference_pages_are_generated_from_the_code(site):
    from app.settings import setting_fields

    settings = (site / "reference" / "settings.html").read_text()
    for f in setting_fields():
        assert f"DETECT_{f.name.upper()}" in settings, f.name
    cli = (site / "reference" / "cli.html").read_text()
    for command in ("serve", "fleet", "calibrate", "train", "export", "evaluate"):
        assert f"usage: python -m app {command}" in cli, command
    metrics = (site / "reference" / "metrics.html").read_text()
    assert "detect_http_requests_total" in metrics and "detect_model_memory_cap_bytes" in metrics
    routes = (site / "reference" / "http-routes.html").read_text()
    document = json.loads((site / "reference" / "openapi.json").read_text())
    for path in document["paths"]:
        assert path in routes, path
    errors = (site / "reference" / "errors.html").read_text()
    assert "insufficient_gpu_memory" in errors and "invalid_setting" in errors
    assert "<!-- generated:" not in "".join(p.read_text() for p in site.rglob("*.html"))


def test_an_unknown_generated_marker_is_an_error():
    with pytest.raises(KeyError, match="no generator"):
        docs_hooks.render("<!-- generated: nothing -->")


# The examples -------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def example_server(tmp_path_factory):
    """The server `scripts/run` starts: the committed repository with config/default.toml, precision auto."""
    log_path = tmp_path_factory.mktemp("docs-server") / "server.log"
    server = start_server({"DETECT_PRECISION": None}, log_path)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    """A folder whose bin/ holds a `python` that is this venv's, for the examples that name `.venv/bin/python`."""
    folder = tmp_path_factory.mktemp("docs-examples")
    bin_dir = folder / "bin"
    bin_dir.mkdir()
    wrapper = bin_dir / "python"  # a script, not a link: a link to a venv's python does not find the venv
    wrapper.write_text(f"#!/bin/sh\nexec {shlex.quote(sys.executable)} \"$@\"\n")
    wrapper.chmod(0o755)
    return folder


def failing_on_http_errors(command: str) -> str:
    """Make each curl of a command fail on a 4xx or 5xx answer, showing its body, as a reader would notice it."""
    return re.sub(r"(^|\n|&&\s*|\|\s*)curl ", r"\1curl -sS --fail-with-body ", command)


def run_step(step: Step, block: Block, port: int, workdir: Path, grpc_port: int | None = None
             ) -> subprocess.CompletedProcess:
    command = step.command.replace("localhost:8000", f"localhost:{port}").replace(".venv/bin/python", "python")
    if grpc_port is not None:  # the gRPC examples name serve's default gRPC port, 8001
        command = command.replace("localhost:8001", f"localhost:{grpc_port}")
    if int(block.options.get("exit", 0)) == 0:
        command = failing_on_http_errors(command)
    env = {k: v for k, v in os.environ.items() if not k.startswith("DETECT_")}
    env.update(PATH=f"{workdir / 'bin'}{os.pathsep}{env['PATH']}", PYTHONPATH=str(ROOT), TF_CPP_MIN_LOG_LEVEL="2")
    return subprocess.run(["bash", "-c", command], cwd=ROOT, env=env, capture_output=True, text=True, timeout=180)


@pytest.mark.parametrize("page", sorted({block.page for block in ALL_BLOCKS}))
def test_the_documented_examples_run_and_answer_as_shown(page, example_server, workdir):
    for block in (b for b in ALL_BLOCKS if b.page == page):
        where = f"{block.page}:{block.line}"
        if block.lang == "python":
            code = block.body.replace("localhost:8000", f"localhost:{example_server.port}").replace(
                "localhost:8001", f"localhost:{example_server.grpc_port}")
            result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                                    timeout=180, env={**os.environ, "PYTHONPATH": str(ROOT)})
            assert result.returncode == 0, f"{where}: the Python example failed:\n{result.stderr[-3000:]}"
            continue
        for step in block.steps():
            result = run_step(step, block, example_server.port, workdir, example_server.grpc_port)
            expected_exit = int(block.options.get("exit", 0))
            assert result.returncode == expected_exit, (
                f"{where}: `{step.command.strip()}` exited {result.returncode}, not {expected_exit}:\n"
                f"{result.stdout[-2000:]}{result.stderr[-2000:]}")
            if not step.shown.strip():
                continue
            shown = parse_shown(step.shown)
            if shown is None:  # plain text: shown as it is printed
                assert step.shown.strip() == (result.stdout + result.stderr).strip(), where
            else:
                differences = shape_differences(shown, json.loads(result.stdout))
                assert not differences, f"{where}: `{step.command.strip()}` answers in another shape: {differences}"


def test_an_example_answering_in_another_shape_would_be_seen(workdir):
    """The runner's own check: an example whose answer has another shape is reported, not passed."""
    block = Block("p", 1, "console", "$ echo '{\"a\": 1}'\n{\"b\": 1}\n")
    step = block.steps()[0]
    result = run_step(step, block, 0, workdir)
    assert shape_differences(parse_shown(step.shown), json.loads(result.stdout)) == [
        "answer: shown keys ['b'], got ['a']"]



def test_the_routes_reference_is_rendered_from_the_document_the_server_serves(example_server):
    status, _, served = example_server.request("GET", "/openapi.json")
    assert status == 200 and served == docs_hooks.openapi_document()


def test_the_metrics_reference_lists_every_series_a_running_server_exposes(example_server):
    exposed = re.findall(r"^# TYPE (\S+) (\S+)$", example_server.request("GET", "/metrics")[2].decode(), re.MULTILINE)
    assert len(exposed) > 10
    reference = docs_hooks.metrics_reference()
    for name, kind in exposed:
        shown = name + ("_total" if kind == "counter" and not name.endswith("_total") else "")
        assert f"| `{shown}` | {kind} |" in reference, f"{name} ({kind}) is not in the metrics reference"


# The site in a browser ----------------------------------------------------------------------------------------

LAYOUT = """() => {
  const problems = [];
  for (const code of document.querySelectorAll('.md-typeset table code')) {
    if (code.getClientRects().length > 1) problems.push('a name breaks across lines: ' + code.textContent);
  }
  const text = document.querySelector('.md-content').getBoundingClientRect();  // the scroll box bleeds into the padding
  for (const wrap of document.querySelectorAll('.md-typeset__scrollwrap')) {
    const heading = wrap.querySelector('th') ? wrap.querySelector('th').textContent : '?';
    if (wrap.getBoundingClientRect().right > text.right + 1) problems.push('a table runs off the page: ' + heading);
    const scrolls = ['auto', 'scroll'].includes(getComputedStyle(wrap).overflowX);
    if (wrap.scrollWidth > wrap.clientWidth + 1) {
      problems.push((scrolls ? 'a table scrolls: ' : 'a table is cut off: ') + heading);
    }
  }
  return problems;
}"""


@pytest.mark.browser
@pytest.mark.parametrize("page, may_scroll", [("reference/settings.html", False), ("how-to/coming-from.html", False),
                                              ("reference/metrics.html", True), ("reference/errors.html", True)])
def test_reference_tables_fit_a_1280_px_window_without_breaking_a_name(site, page, may_scroll):
    """In Chromium at 1280 px: no name in a table breaks mid-word, and a table fits the page or scrolls in its box."""
    from test_page import CHROMIUM, CHROMIUM_ARGS, _sync_playwright

    shots = ROOT / "out" / "docs"
    shots.mkdir(parents=True, exist_ok=True)
    with _sync_playwright()() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS)
        try:
            view = browser.new_page(viewport={"width": 1280, "height": 900})
            view.goto((site / page).as_uri())
            problems = view.evaluate(LAYOUT)
            view.screenshot(path=str(shots / (page.replace("/", "-") + ".png")))
        finally:
            browser.close()
    allowed = ("a table scrolls: ",) if may_scroll else ()
    assert [p for p in problems if not p.startswith(allowed)] == [], page
