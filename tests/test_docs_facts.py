"""A fact that appears on several pages has one source, and the pages agree with it.

- Measured figures (speed ratios, latencies, throughput, mAP) live on docs/measured.md. The README and the
  site's home page link there and state none themselves: that is how they disagreed before (0.87 to 0.90
  of the ceiling on one, 1.00x on the other).
- The memory the default run holds at rest is quoted where a newcomer starts (the README's quick start and
  the first tutorial) and must be the figure docs/measured.md measured.
- A page that says what `models/` holds names every model in it.
- A page that quotes the per-worker GPU overhead quotes the default of `gpu_overhead_mib`.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from conftest import ROOT

README, HOME, MEASURED = ROOT / "README.md", ROOT / "docs" / "index.md", ROOT / "docs" / "measured.md"
NEWCOMER_PAGES = [README, ROOT / "docs" / "tutorials" / "first-detection.md"]
# Pages that say what the overhead was before, or that set another one on purpose, name it in their own words.
OVERHEAD_HISTORY = {"docs/changelog.md", "docs/how-to/gpu-check.md", "docs/how-to/chaos.md", "docs/measured.md"}

MEASURED_FIGURE = re.compile(
    r"\d(?:\.\d+)?\s?(?:x|×)(?![\w-])"          # a ratio: 1.00x, 0.94 to 1.06x, 1.6 x
    r"|\d(?:\.\d+)?\s?ms\b"                      # a latency
    r"|\d\s?(?:images|img)/s\b"                  # a throughput
    r"|\bof (?:the|its) (?:in-process )?ceiling"  # a share of the ceiling
    r"|\bmAP\b.{0,40}?\d"                        # an accuracy
)


def prose(path: Path) -> str:
    """The page without its fenced code blocks (commands and answers are not claims)."""
    return re.sub(r"^```.*?^```$", "", path.read_text(), flags=re.MULTILINE | re.DOTALL)


def measured_figures(text: str) -> list[str]:
    return [match.group(0) for match in MEASURED_FIGURE.finditer(text)]


def test_the_figure_finder_sees_the_figures_that_once_disagreed():
    """The check below can fail: the old home page's and README's lines are found."""
    old_home = "at 64 connections the server runs at 0.87 to 0.90 of the in-process ceiling (goal 0.95)"
    old_readme = "the shapes model serves 1.00x its in-process ceiling and 1.6x the best peer; about 3 ms more"
    assert measured_figures(old_home) == ["of the in-process ceiling"]
    assert measured_figures(old_readme) == ["1.00x", "1.6x", "3 ms"]
    assert measured_figures("4 GiB caps, 1024 MiB overhead, 8000 and port 8001, 16x16 pixels") == []


@pytest.mark.parametrize("page", [README, HOME], ids=["README.md", "docs/index.md"])
def test_the_readme_and_the_home_page_state_no_measured_figure_but_link_to_the_one_page(page):
    found = measured_figures(prose(page))
    assert not found, (f"{page.relative_to(ROOT)} states measured figures {found}: keep them on docs/measured.md "
                       "and link there")
    assert "measured.md#where-it-stands" in page.read_text(), f"{page.relative_to(ROOT)} must link to where it stands"


def test_the_page_they_link_to_holds_what_stands_and_the_memory_at_rest():
    text = MEASURED.read_text()
    assert "\n## Where it stands\n" in text and "\n## Memory at rest\n" in text


def test_the_memory_at_rest_a_newcomer_reads_is_the_measured_one():
    figure = re.compile(r"about (\d+(?:\.\d+)?) GB\s+resident")
    measured = figure.search(MEASURED.read_text().replace("(about ", "about ").replace(" GB)", " GB resident"))
    assert measured, "docs/measured.md's memory-at-rest table gives no 'about N GB' figure"
    for page in NEWCOMER_PAGES:
        quoted = figure.findall(prose(page))
        assert quoted, f"{page.relative_to(ROOT)} does not say what the default run holds"
        assert set(quoted) == {measured.group(1)}, (
            f"{page.relative_to(ROOT)} says about {quoted} GB at rest; docs/measured.md measured {measured.group(1)}")


def all_pages() -> list[Path]:
    return [README, *sorted((ROOT / "docs").rglob("*.md"))]


def test_every_page_that_lists_the_served_models_names_all_of_them():
    served = {path.parent.parent.name for path in (ROOT / "models").glob("*/*/saved_model.pb")}
    assert {"objects", "faces", "shapes"} <= served
    listing = re.compile(r"serves\s+`?models/`?\s+\(([^)]*)\)")
    seen = 0
    for page in all_pages():
        for names in listing.findall(page.read_text()):
            seen += 1
            named = set(re.findall(r"[a-z]+", names)) - {"and", "the", "every", "model", "models"}
            assert named == served, f"{page.relative_to(ROOT)} says models/ holds {sorted(named)}, not {sorted(served)}"
    assert seen >= 2, "the README and the first tutorial say what scripts/run serves"


def test_a_quoted_per_worker_overhead_is_the_default():
    from app.settings import Settings

    default = Settings().gpu_overhead_mib
    quoted = re.compile(r"cap plus (\d+) MiB|(\d+) MiB (?:per|a) (?:worker|process)|`gpu_overhead_mib` \((?:default )?(\d+)"
                        r"|(?:often )?(\d+) to \d+ MiB per process")
    for page in all_pages():
        relative = str(page.relative_to(ROOT))
        if relative in OVERHEAD_HISTORY:
            continue
        for match in quoted.finditer(prose(page) if page.suffix == ".md" else page.read_text()):
            value = int(next(group for group in match.groups() if group))
            assert value == default, f"{relative}: '{match.group(0)}', but gpu_overhead_mib defaults to {default}"
    for path in (ROOT / "compose.yaml", ROOT / "config" / "default.toml"):
        for match in re.finditer(r"~?(\d+) MiB per process", path.read_text()):
            assert int(match.group(1)) == default, f"{path.relative_to(ROOT)}: '{match.group(0)}'"


def security_rows() -> dict[str, str]:
    """SECURITY.md's table of groups: each group's row, by the group's name."""
    text = (ROOT / "SECURITY.md").read_text()
    return {match.group(1): match.group(0) for match in re.finditer(r"^\| `([a-z-]+)` \|.*$", text, re.MULTILINE)}


def test_security_md_lists_every_group_and_every_grpc_method_in_the_group_the_code_gives_it():
    """The table of who may reach what is the code's: every restricted-API group has a row, and every gRPC method
    the code puts in a group is named in that group's row (METHOD_GROUPS), so the page cannot say a method is
    metadata when the code restricts it, as it once said of the shared-memory and config methods."""
    from app.access import GROUPS
    from app.grpc.calls import METHOD_GROUPS

    rows = security_rows()
    assert set(GROUPS) <= set(rows), f"groups without a row in SECURITY.md: {set(GROUPS) - set(rows)}"
    for method, group in METHOD_GROUPS.items():
        name = method.rsplit("/", 1)[1]
        assert f"`{name}`" in rows[group], f"SECURITY.md does not name {name} in the {group} row"
        others = [g for g, row in rows.items() if g != group and re.search(rf"`{name}`", row)]
        assert not others, f"SECURITY.md also names {name} under {others}"


def test_security_md_puts_each_http_probe_and_control_route_in_the_group_the_code_gives_it():
    from app.http.access import route_group

    rows = security_rows()
    for path in ("/healthz", "/readyz", "/v2/health/live", "/v2/health/ready", "/metrics", "/v2/models/stats",
                 "/v2/repository/index", "/v2/systemsharedmemory/status", "/v2/logging", "/openapi.json", "/gpu"):
        # Written whole, or as a folder of routes (`/v2/systemsharedmemory/...`).
        written = [path] + [path[:i + 1] + "..." for i, c in enumerate(path) if c == "/" and i > 0]
        row = rows[route_group(path)]
        assert any(re.search(rf"[` ]{re.escape(form)}[`\[]", row) for form in written), \
            f"SECURITY.md does not put {path} under {route_group(path)}"
