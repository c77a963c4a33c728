"""The package's layout rules, read from the source: folders by lifecycle, each importing
only the floors below it, no import cycle, a pure planner, and a loader that imports
nothing heavy inside vLLM until it needs it."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest
from vllm_env import require_python

PACKAGE = Path(__file__).resolve().parents[1] / "shardprep"
# Lowest first: a module may import its own floor and the floors below, never above.
FLOORS: tuple[tuple[str, ...], ...] = (
    (
        "shardprep",
        "shardprep.errors",
        "shardprep.constants",
        "shardprep.hashing",
        "shardprep.progress",
        "shardprep.safefs",
    ),
    ("shardprep.format",),
    ("shardprep.codec",),
    ("shardprep.plan",),
    ("shardprep.report",),
    ("shardprep.hub_client",),  # the Hub client's edges: a Hub source is read in convert/
    ("shardprep.convert",),
    ("shardprep.hub",),
    ("shardprep.loader",),
    ("shardprep.demo",),
    ("shardprep.cli",),
)


def _modules() -> dict[str, Path]:
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        found[name] = path
    return found


MODULES = _modules()


def _imports(name: str, path: Path) -> set[str]:
    """Every shardprep module `name` imports, at module level or inside a function."""
    return imports_in(name, path.name == "__init__.py", path.read_text())


def imports_in(name: str, is_package: bool, source: str) -> set[str]:
    """The shardprep modules that `source` (module `name`) imports: import statements, and
    `importlib.import_module("...")` (or `__import__`) of a string written in it."""
    package = name if is_package else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the package, `level - 1` folders up
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*parts, base]).strip(".")
            targets = [
                f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base for a in node.names
            ]
        elif isinstance(node, ast.Call):
            targets = _string_import(node, package)
        found |= {t for t in targets if t in MODULES and t != name}
    return found


def _string_import(call: ast.Call, package: str) -> list[str]:
    """The module a call such as `importlib.import_module("shardprep.x")` loads, if its
    name is a string in the source (a relative one against `package`)."""
    func = ast.unparse(call.func)
    if not (func == "__import__" or func.endswith("import_module")) or not call.args:
        return []
    first = call.args[0]
    if not (isinstance(first, ast.Constant) and isinstance(first.value, str)):
        return []
    target = first.value
    if target.startswith("."):
        dots = len(target) - len(target.lstrip("."))
        parts = package.split(".")[: len(package.split(".")) - dots + 1]
        target = ".".join([*parts, target.lstrip(".")]).strip(".")
    return [target]


GRAPH = {name: _imports(name, path) for name, path in MODULES.items()}


def floor_of(module: str) -> int:
    best = [
        (len(prefix), index)
        for index, floor in enumerate(FLOORS)
        for prefix in floor
        if module == prefix or module.startswith(prefix + ".")
    ]
    assert best, f"{module} is on no floor; add its folder to FLOORS and the README"
    return max(best)[1]


def test_the_package_root_holds_at_most_eight_modules() -> None:
    """What has a concern of its own lives in its folder: the root keeps the ground floor
    and the few edges every folder shares."""
    flat = sorted(p.name for p in PACKAGE.glob("*.py") if p.name != "__init__.py")
    assert len(flat) <= 8, flat


def test_every_module_is_on_a_floor() -> None:
    for module in MODULES:
        floor_of(module)


def test_no_import_runs_up_a_floor() -> None:
    upward = [
        f"{module} -> {target}"
        for module, targets in sorted(GRAPH.items())
        for target in sorted(targets)
        if floor_of(target) > floor_of(module)
    ]
    assert not upward, upward


def cycles_in(graph: dict[str, set[str]]) -> list[list[str]]:
    """Each circle a depth-first walk of `graph` meets, as the path that closes it."""
    state: dict[str, int] = {}
    cycles: list[list[str]] = []

    def visit(module: str, path: list[str]) -> None:
        state[module] = 1
        for target in sorted(graph[module]):
            if state.get(target) == 1:
                cycles.append([*path[path.index(target) :], target])
            elif target not in state:
                visit(target, [*path, target])
        state[module] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])
    return cycles


def test_the_import_graph_has_no_cycle() -> None:
    cycles = cycles_in(GRAPH)
    assert not cycles, cycles


def test_a_circle_through_importlib_would_be_seen() -> None:
    """A module loaded by `importlib.import_module` with its name written out counts as an
    import: the codec's reassembly loads its compiled loops that way, and a circle closed
    through such a call (the compiled loops importing what imports reassembly) is caught."""
    loads = (
        'importlib.import_module("shardprep.codec.compiled")',
        'import_module(".compiled", __package__)',
        '__import__("shardprep.codec.compiled")',
    )
    for load in loads:
        graph = {
            "shardprep.codec.reassembly": imports_in("shardprep.codec.reassembly", False, load),
            "shardprep.codec.compiled": imports_in(
                "shardprep.codec.compiled", False, "from shardprep.codec import transforms"
            ),
            "shardprep.codec.transforms": imports_in(
                "shardprep.codec.transforms", False, "from shardprep.codec.reassembly import spread"
            ),
        }
        assert cycles_in(graph) == [
            [
                "shardprep.codec.compiled",
                "shardprep.codec.transforms",
                "shardprep.codec.reassembly",
                "shardprep.codec.compiled",
            ]
        ], load
    assert "shardprep.codec.compiled" in GRAPH["shardprep.codec.reassembly"]


# Packages whose __init__.py only names what their modules hold: a reader opens them to
# find the public API, not to read an implementation.
THIN_FACES = ("codec", "cli")


def test_the_thin_faces_define_nothing() -> None:
    for folder in THIN_FACES:
        body = ast.parse((PACKAGE / folder / "__init__.py").read_text()).body
        defined = [
            ast.unparse(node).split("\n")[0]
            for node in body
            if not isinstance(node, (ast.Import, ast.ImportFrom))
            and not (isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant))
            and not (isinstance(node, ast.Assign) and ast.unparse(node.targets[0]) == "__all__")
        ]
        assert not defined, (folder, defined)


def test_format_knows_no_family() -> None:
    """The contract names no tensor and imports nothing above the ground floor."""
    for module, targets in GRAPH.items():
        if floor_of(module) == 1:
            assert {floor_of(t) for t in targets} <= {0, 1}, (module, targets)
    for path in (PACKAGE / "format").glob("*.py"):
        text = path.read_text()
        named = [n for n in ("q_proj", "gate_proj", "embed_tokens", "model.layers") if n in text]
        assert not named, (path, named)


ARCHS = "shardprep.plan.archs"
SHARED = ("base", "parts")  # what every family may import of plan/archs


def archs_unit(module: str) -> str | None:
    """The room of plan/archs a module is in: a family's module or folder (`kimi_k3`),
    `base` or `parts`; None outside plan/archs and for the registry itself."""
    if not module.startswith(ARCHS + "."):
        return None
    return module.removeprefix(ARCHS + ".").split(".")[0]


def draft_targets() -> dict[str, set[str]]:
    """The family rooms each draft's room may import: its targets' (the registry's
    (method, target) keys), a draft for any target none."""
    from shardprep.plan import archs

    def room(module: str) -> str:
        return str(archs_unit(f"{ARCHS}{module}"))

    names = {archs._instance(*entry).name: room(entry[0]) for entry in archs._TARGETS.values()}
    allowed: dict[str, set[str]] = {}
    for (_, target), (module, _) in archs._DRAFTS.items():
        if target in names:
            allowed.setdefault(room(module), set()).add(names[target])
    return allowed


def family_violations(graph: dict[str, set[str]], drafts: dict[str, set[str]]) -> list[str]:
    """Imports inside plan/archs that break its rooms: a family imports `base`, `parts/` and
    its own room (a draft also its target's), a part only `base` and `parts/`, `base`
    nothing of plan/archs; none imports the registry."""
    found = []
    for module, targets in sorted(graph.items()):
        unit = archs_unit(module)
        if unit is None:
            continue
        allowed = {"base"} if unit == "base" else {*SHARED, unit, *drafts.get(unit, ())}
        if unit == "parts":
            allowed = set(SHARED)
        for target in sorted(targets):
            if target == ARCHS or (
                target.startswith(ARCHS + ".") and archs_unit(target) not in allowed
            ):
                found.append(f"{module} -> {target}")
    return found


def test_a_family_imports_no_other_family() -> None:
    assert not family_violations(GRAPH, draft_targets()), family_violations(GRAPH, draft_targets())


def test_a_family_importing_another_would_be_seen() -> None:
    """The guard above on made-up imports: each of these breaks a room of plan/archs."""
    graph = {
        f"{ARCHS}.kimi_k3.family": {f"{ARCHS}.deepseek.v3"},
        f"{ARCHS}.parts.mla": {f"{ARCHS}.llama"},
        f"{ARCHS}.base": {f"{ARCHS}.parts.mla"},
        f"{ARCHS}.llama": {ARCHS},
        f"{ARCHS}.kimi_k3.mtp": {f"{ARCHS}.kimi_k3.family", f"{ARCHS}.parts.mla"},  # allowed
        f"{ARCHS}.mtp_of_llama": {f"{ARCHS}.llama"},  # allowed: a draft of a llama target
    }
    drafts = {"mtp_of_llama": {"llama"}}
    assert family_violations(graph, drafts) == [
        f"{ARCHS}.base -> {ARCHS}.parts.mla",
        f"{ARCHS}.kimi_k3.family -> {ARCHS}.deepseek.v3",
        f"{ARCHS}.llama -> {ARCHS}",
        f"{ARCHS}.parts.mla -> {ARCHS}.llama",
    ]


WEIGHT_READERS = ("safe_open", "read_header", "torch.load", "np.fromfile", "mmap", "open(")


def _names(call: str, reader: str) -> bool:
    """Whether the called name is `reader` or ends in it after a dot (`path.open(`, not
    `subprocess.Popen(`)."""
    return re.search(r"(^|[^\w])" + re.escape(reader), call) is not None


def test_plan_opens_no_weight_file() -> None:
    """plan/ turns headers and configs into records; every byte is read in convert/."""
    for path in sorted((PACKAGE / "plan").rglob("*.py")):
        tree = ast.parse(path.read_text())
        calls = {
            ast.unparse(node.func) + "(" for node in ast.walk(tree) if isinstance(node, ast.Call)
        }
        used = [r for r in WEIGHT_READERS if any(_names(call, r) for call in calls)]
        imported = {
            alias.name
            for node in ast.walk(tree)
            if isinstance(node, (ast.Import, ast.ImportFrom))
            for alias in node.names
        } | {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
        assert not used, (path, used)
        assert not {"safetensors", "safetensors.torch", "mmap"} & imported, path


def test_a_weight_reader_in_plan_would_be_seen(tmp_path: Path) -> None:
    """The guard above reads calls as written: it sees each reader it names."""
    for reader in WEIGHT_READERS:
        tree = ast.parse(f"x = {reader.rstrip('(')}('f')")
        calls = {ast.unparse(n.func) + "(" for n in ast.walk(tree) if isinstance(n, ast.Call)}
        assert any(reader in call for call in calls), reader


LOADER_IMPORT = """
import sys
import shardprep.loader.plugin
mods = sorted(m for m in sys.modules if m.startswith("shardprep"))
print("\\n".join(mods))
"""


@pytest.mark.vllm
def test_loader_imports_only_format_inside_vllm() -> None:
    """What a vLLM worker imports of shardprep when the plugin loads: the ground floor,
    format/ and loader/ only (plan/ comes later, for a draft's hooks)."""
    out = subprocess.run(
        [require_python(), "-c", LOADER_IMPORT], capture_output=True, text=True, check=True
    ).stdout.split()
    above = [m for m in out if floor_of(m) not in (0, 1) and not m.startswith("shardprep.loader")]
    assert "shardprep.loader.plugin" in out
    assert not above, above


def test_loader_imports_only_format_at_import_time() -> None:
    """The same rule, read from the source: loader/'s module-level imports."""
    for name, path in MODULES.items():
        if not name.startswith("shardprep.loader"):
            continue
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("shardprep"):
                assert floor_of(node.module or "") in (0, 1) or node.module.startswith(
                    "shardprep.loader"
                ), (name, node.module)


if __name__ == "__main__":
    sys.exit(pytest.main([__file__]))
