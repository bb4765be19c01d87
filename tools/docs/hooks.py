"""MkDocs hooks: render the reference pages from the code that defines them, at build time.

A page asks for generated text with a marker line, `<!-- generated: NAME -->`, which `on_page_markdown`
replaces with GENERATED[NAME](): the settings table (app/settings.py, through tools/docs/settings_table.py),
the CLI (each command's argparse parser), the metrics (the registry app/metrics.py builds), the HTTP routes
(app/http/openapi.py's document, also written to the site as reference/openapi.json), the error codes
(app/errors.py's tree and each protocol's status table), and SECURITY.md and CHANGELOG.md from the
repository's root. Nothing generated is committed, so nothing generated can go stale.

MkDocs loads this file by its path, so it must run as `python -m mkdocs` from the repository's root (as
scripts/docs and the tests run it): that puts the root first on the path, and with it this checkout's `app`
and `tools`.
"""

from __future__ import annotations

import argparse
import functools
import json
import re

try:
    from tools import ROOT
except ModuleNotFoundError as exc:  # plain `mkdocs`: its own folder on the path, not the repository's root
    raise SystemExit("the docs hooks need the repository's root on the path: run `python -m mkdocs` there "
                     "(scripts/docs does)") from exc

MARKER = re.compile(r"^<!-- generated: (?P<name>[^>]+?) -->$", re.MULTILINE)
HELP_WIDTH = 100  # the CLI reference's line width, whatever the terminal that builds the site


def _escape(text: str) -> str:
    """Make plain text safe in a markdown table cell."""
    return (str(text).replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;").replace("|", "\\|")
            .replace("\n", " "))


def _sentence(text: str) -> str:
    text = _escape(text)
    return text[:1].upper() + text[1:] + "."


def settings_table() -> str:
    from tools.docs.settings_table import settings_table as table

    return table()


def cli_reference() -> str:
    """Every command's --help, as argparse prints it."""
    from app.__main__ import COMMANDS, parser_of, usage

    parts = ["## `python -m app`", "", "```text", usage(), "```", ""]
    for command in COMMANDS:
        parser = parser_of(command)
        parser.formatter_class = functools.partial(argparse.HelpFormatter, width=HELP_WIDTH)
        parts += [f"## `python -m app {command}`", "", "```text", parser.format_help().rstrip(), "```", ""]
    return "\n".join(parts)


class _Device:
    index, uuid, memory_used_mib, memory_total_mib = 0, "GPU-0", 1.0, 2.0


class _GpuReport:
    """Stands in for app.gpu.report.GpuReport: one GPU, so the GPU gauges are collected."""

    def devices(self):
        return [_Device()]


class _Models:
    """Stands in for the model registry: one model with every figure, so every per-model gauge is collected."""

    def describe(self):
        return [{"name": "m", "state": "ready", "pid": 1, "queue_depth": 0, "caps_mib": {"0": 1},
                 "memory": {"source": "nvml", "used_mib": 1.0, "tensorflow": [{"current_mib": 1.0}]}}]


def _label_names(metric) -> tuple[str, ...]:
    # prometheus-client keeps the label names of both its metric objects and its families in _labelnames.
    return tuple(getattr(metric, "_labelnames", ()))


def metrics_reference() -> str:
    """Every series ServiceMetrics registers, with its type, labels and help, as /metrics names it."""
    from prometheus_client import Counter, Histogram

    from app.metrics import ServiceMetrics

    metrics = ServiceMetrics(_GpuReport())
    metrics.watch_in_flight(lambda: 0)
    metrics.watch_models(_Models())
    rows = []
    for collector in list(metrics.registry._collector_to_names):  # every collector registered, in order
        if hasattr(collector, "_name") and hasattr(collector, "_type"):  # a Counter, Gauge or Histogram object
            name = collector._name + ("_total" if isinstance(collector, Counter) else "")
            kind = "histogram" if isinstance(collector, Histogram) else collector._type
            rows.append((name, kind, _label_names(collector), collector._documentation))
        else:  # a collector that reads the registry or NVML at scrape time
            for family in collector.collect():
                rows.append((family.name, family.type, _label_names(family), family.documentation))
    lines = ["| series | type | labels | meaning |", "|---|---|---|---|"]
    for name, kind, labels, text in rows:
        shown = ", ".join(f"`{label}`" for label in labels) or "none"
        lines.append(f"| `{name}` | {kind} | {shown} | {_escape(text)} |")
    return "\n".join(lines)


def stages_reference() -> str:
    """The stages of an inference request (app/timeline.py), in the order a request meets them."""
    from app.timeline import STAGES

    rows = ["| stage | what it times |", "|---|---|"]
    rows += [f"| `{stage}` | {_sentence(text)} |" for stage, text in STAGES.items()]
    return "\n".join(rows) + "\n"


def openapi_document() -> dict:
    """The document GET /openapi.json serves, for a server holding the committed models."""
    from app import __version__
    from app.protocol.plane import SERVER_NAME
    from app.http.openapi import document

    models = sorted(p.name for p in (ROOT / "models").iterdir() if p.is_dir())
    return document(models, __version__, SERVER_NAME)


def _schema_text(schema: dict) -> str:
    if "$ref" in schema:
        name = schema["$ref"].rsplit("/", 1)[-1]
        return f"[`{name}`](#schema-{name.lower()})"
    kind = schema.get("type", "")
    if kind == "array" and "items" in schema:
        return f"array of {_schema_text(schema['items'])}"
    if "enum" in schema:
        return " or ".join(f"`{value}`" for value in schema["enum"])
    if isinstance(kind, list):
        return " or ".join(kind)
    return kind or "any"


def http_reference() -> str:
    """Every path and operation of the OpenAPI document, then its schemas."""
    doc = openapi_document()
    out = [f"OpenAPI {doc['openapi']}, version {doc['info']['version']} of the service. "
           "[Download the document](openapi.json) as the server at `/openapi.json` gives it "
           "(there, the model names are those of the server's own repository).", ""]
    for tag in doc["tags"]:
        out += [f"## `{tag['name']}`", ""]
        if tag.get("description"):
            out += [_escape(tag["description"]), ""]
        for path, operations in doc["paths"].items():
            for method, op in operations.items():
                if tag["name"] not in op.get("tags", ()):
                    continue
                out += [f"### {method.upper()} `{path}`", "", _sentence(op.get("summary", "")), ""]
                if op.get("parameters"):
                    out += ["| parameter | in | required | schema | meaning |", "|---|---|---|---|---|"]
                    for p in op["parameters"]:
                        out.append(f"| `{p['name']}` | {p['in']} | {'yes' if p.get('required') else 'no'} | "
                                   f"{_schema_text(p.get('schema', {}))} | {_escape(p.get('description', ''))} |")
                    out.append("")
                if op.get("requestBody"):
                    kinds = ", ".join(f"`{kind}`" for kind in op["requestBody"]["content"])
                    out += [f"Request body: {kinds}.", ""]
                out += ["| status | meaning | body |", "|---|---|---|"]
                for status, response in op["responses"].items():
                    bodies = response.get("content", {})
                    body = "; ".join(f"`{kind}` {_schema_text(content.get('schema', {}))}"
                                     for kind, content in bodies.items()) or "empty"
                    headers = ", ".join(f"`{h}`" for h in response.get("headers", {}))
                    meaning = _escape(response.get("description", "")) + (f" (header {headers})" if headers else "")
                    out.append(f"| {status} | {meaning} | {body} |")
                out.append("")
    out += ["## Schemas", ""]
    for name, schema in doc["components"]["schemas"].items():
        out += [f'### `{name}` {{ #schema-{name.lower()} }}', ""]
        if schema.get("description"):
            out += [_escape(schema["description"]), ""]
        properties = schema.get("properties", {})
        if properties:
            required = set(schema.get("required", ()))
            out += ["| field | schema | required | meaning |", "|---|---|---|---|"]
            for field, spec in properties.items():
                out.append(f"| `{field}` | {_schema_text(spec)} | {'yes' if field in required else 'no'} | "
                           f"{_escape(spec.get('description', ''))} |")
        else:
            out.append(f"{_schema_text(schema)}.")
        out.append("")
    return "\n".join(out)


def errors_reference() -> str:
    """Every request error: its code, its status in each protocol, Retry-After, and what it means."""
    from app.http.errors import status_of
    from app.http.paths import DETECT, V1, V2

    from app.errors import grpc_status, request_errors

    lines = ["| code | `/detect`, `/models`, `/gpu` | `/v2` (KServe) | `/v1` (TF Serving) | gRPC (both) | Retry-After | "
             "meaning |", "|---|---|---|---|---|---|---|"]
    for cls in request_errors():
        error = cls("")
        retry = f"{cls.retry_after_s} s" if getattr(cls, "retry_after_s", None) is not None else ""
        doc = (cls.__doc__ or "").strip().splitlines()[0]
        lines.append(f"| `{cls.code}` | {status_of(error, DETECT)} | {status_of(error, V2)} | "
                     f"{status_of(error, V1)} | `{grpc_status(error)}` | {retry} | {_escape(doc)} |")
    return "\n".join(lines)


def boot_errors_reference() -> str:
    """The errors that stop a command at boot (exit status 2), and NVML's."""
    import app.fleet.calibrate  # noqa: F401  (defines CalibrationError)
    from app.errors import DetectError, RequestError

    lines = ["| error | code | meaning |", "|---|---|---|"]
    for cls in DetectError.__subclasses__():
        if cls is RequestError:
            continue
        doc = (cls.__doc__ or "").strip().splitlines()[0]
        lines.append(f"| `{cls.__name__}` | `{cls.code}` | {_escape(doc)} |")
    return "\n".join(lines)


def _repository_file(name: str) -> str:
    """A file from the repository's root, its title dropped (the page has its own) and its links made to work."""
    text = (ROOT / name).read_text()
    text = re.sub(r"\A# .*\n", "", text)
    # A relative link in the file points into the repository, not the site: show it as code.
    return re.sub(r"\[([^\]]+)\]\((?!https?://|#)([^)]+)\)", r"\1 (`\2`)", text)


GENERATED = {
    "settings table": settings_table,
    "cli": cli_reference,
    "metrics": metrics_reference,
    "request stages": stages_reference,
    "http routes": http_reference,
    "error codes": errors_reference,
    "boot errors": boot_errors_reference,
    "SECURITY.md": lambda: _repository_file("SECURITY.md"),
    "CHANGELOG.md": lambda: _repository_file("CHANGELOG.md"),
}


def render(markdown: str) -> str:
    """Replace each marker with its generated text; an unknown name is an error, not a silent gap."""
    def replace(match: re.Match) -> str:
        name = match.group("name")
        if name not in GENERATED:
            raise KeyError(f"no generator for <!-- generated: {name} -->; known: {', '.join(GENERATED)}")
        return GENERATED[name]()

    return MARKER.sub(replace, markdown)


# MkDocs hook functions


def on_page_markdown(markdown, page, config, files):
    return render(markdown)


def on_files(files, config):
    from mkdocs.structure.files import File

    files.append(File.generated(config, "reference/openapi.json", content=json.dumps(openapi_document(), indent=2)))
    return files
