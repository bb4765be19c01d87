"""The shape of app/, read from its imports: layers, no cycles, two front doors over one protocol floor.

Every `import` and `from ... import` in app/ counts, those inside functions too (a lazy import is still a
dependency), except those under `if TYPE_CHECKING:`, which name types for annotations and never run.
docs/development.md draws the layers these tests hold.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
APP = ROOT / "app"

# Each package's layer, lowest first; a module may import its own layer and those below it.
LAYERS = {
    "app": 0, "app.errors": 0, "app.access": 0, "app.timeline": 0, "app.process": 0, "app.supervision": 0,
    "app.cancellation": 0,
    "app.gpu": 1, "app.inference": 1, "app.vision": 1, "app.metrics": 1,
    "app.settings": 2, "app.settings_groups": 2,
    "app.models": 3,
    "app.protocol": 4,
    "app.http": 5, "app.grpc": 5,
    "app.hosting": 6, "app.fleet": 6, "app.training": 6,
    "app.__main__": 7,
}
# The imports that still reach up a layer, each with its reason; a new one fails the test.
KNOWN_UPWARD = {
    ("app.gpu.report", "app.fleet.state"): "/gpu names each process by the fleet instance that owns it, from the "
                                           "fleet's state file",
    ("app.inference.detector", "app.models.repository"): "the worker loads a version folder as the repository "
                                                         "resolves it",
}
WEB = ("flask", "werkzeug")


def module_files() -> dict[str, Path]:
    """Every module of app/ by its dotted name; the generated messages aside."""
    found = {}
    for path in APP.rglob("*.py"):
        if "protos" in path.relative_to(APP).parts:
            continue
        parts = path.relative_to(ROOT).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        found[name] = path
    return found


def imports_of(name: str, path: Path) -> set[str]:
    """The dotted names a module imports (the module, and each name taken from it, which may be a module)."""
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    tree = ast.parse(path.read_text())
    typing_only = {id(node) for block in ast.walk(tree)
                   if isinstance(block, ast.If) and isinstance(block.test, ast.Name) and block.test.id == "TYPE_CHECKING"
                   for node in ast.walk(block)}
    names = set()
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[:len(package) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module
            names.add(target)
            names.update(f"{target}.{alias.name}" for alias in node.names)
    return names


MODULES = module_files()
IMPORTS = {name: imports_of(name, path) for name, path in MODULES.items()}
EDGES = {name: {target for target in targets if target in MODULES and target != name}
         for name, targets in IMPORTS.items()}


def layer_of(module: str) -> int:
    parts = module.split(".")
    for end in range(len(parts), 0, -1):
        if ".".join(parts[:end]) in LAYERS:
            return LAYERS[".".join(parts[:end])]
    raise AssertionError(f"{module} is in no layer: add its package to LAYERS (and to docs/development.md)")


def outside(module: str, packages: tuple[str, ...]) -> list[str]:
    """The imports of `module` that are one of `packages` or inside one."""
    return sorted(t for t in IMPORTS[module] if any(t == p or t.startswith(p + ".") for p in packages))


def in_package(package: str) -> list[str]:
    return [m for m in MODULES if m == package or m.startswith(package + ".")]


def test_every_module_of_app_is_in_a_layer():
    for module in MODULES:
        layer_of(module)


def test_no_import_cycle_anywhere_in_app():
    """Strongly connected components of the import graph (Tarjan's algorithm): none may hold two modules."""
    index, low, stack, on_stack, cycles = {}, {}, [], set(), []

    def visit(module):
        index[module] = low[module] = len(index)
        stack.append(module)
        on_stack.add(module)
        for target in EDGES[module]:
            if target not in index:
                visit(target)
                low[module] = min(low[module], low[target])
            elif target in on_stack:
                low[module] = min(low[module], index[target])
        if low[module] == index[module]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == module:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for module in sorted(MODULES):
        if module not in index:
            visit(module)
    assert cycles == []


def test_imports_reach_up_a_layer_only_where_named():
    upward = {(module, target) for module, targets in EDGES.items() for target in targets
              if layer_of(target) > layer_of(module)}
    assert upward <= set(KNOWN_UPWARD), f"new upward imports: {sorted(upward - set(KNOWN_UPWARD))}"
    assert len(upward) < 5  # 6 before the protocol floor by these layers (issue 37 counted 5 by its own)


def test_the_protocol_floor_imports_no_front_door_and_no_wire_library():
    for module in in_package("app.protocol"):
        assert outside(module, ("app.http", "app.grpc", "app.hosting", "grpc", "google.protobuf", *WEB)) == [], module


@pytest.mark.parametrize("door, other", [("app.http", "app.grpc"), ("app.grpc", "app.http")])
def test_neither_front_door_imports_the_other(door, other):
    for module in in_package(door):
        assert outside(module, (other,)) == [], module


def test_grpc_imports_no_flask():
    for module in in_package("app.grpc"):
        assert outside(module, WEB) == [], module


@pytest.mark.parametrize("step", ["request_options", "request_images", "wanted_outputs", "output_tensors",
                                  "run_images", "signature_of"])
def test_the_v2_infer_sequence_is_written_once_in_the_protocol_floor(step):
    """The steps of an inference are called from app/protocol only: each front door calls `v2.infer` or
    `v1.predict`, never the steps themselves. Two exceptions: /detect, a protocol only HTTP speaks, runs its
    images itself; metadata routes ask for the signature."""
    callers = set()
    for module, path in MODULES.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call):
                called = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", None)
                if called == step:
                    callers.add(module)
    doors = {m for m in callers if not m.startswith("app.protocol")}
    if step == "signature_of":
        # model metadata over HTTP v1 and TF Serving's GetModelMetadata load the model for its signature
        assert doors <= {"app.http.v1", "app.grpc.tfserving"}, doors
    elif step == "run_images":
        assert doors == {"app.http.detect"}, doors
    else:
        assert doors == set(), doors
        assert callers, f"{step} is called nowhere"


def test_a_grpc_model_infer_runs_through_the_protocol_floor_only():
    """ModelInfer's module imports the floor for its logic and nothing of HTTP's, directly or through a module
    it imports."""
    seen, todo = set(), ["app.grpc.kserve"]
    while todo:
        module = todo.pop()
        if module in seen:
            continue
        seen.add(module)
        todo.extend(EDGES[module])
    assert not [m for m in seen if m.startswith("app.http")]
    assert "app.protocol.v2" in seen and "app.protocol.plane" in seen


def test_no_module_of_app_is_over_600_lines():
    long = {m: n for m, p in MODULES.items() if (n := len(p.read_text().splitlines())) > 600}
    assert long == {}
