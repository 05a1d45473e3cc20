"""The core (everything but the ranks of a real probe) imports no torch, transformers or
DeepSpeed: `autotune plan`, `best`, `trials` and a simulated search answer without them."""

from __future__ import annotations

import ast
import json
import re
import subprocess
import sys
from pathlib import Path

PACKAGE = Path(__file__).parents[1] / "autotune"
HEAVY = ("torch", "transformers", "deepspeed")
# Where torch may be imported at module level: the ranks' side of the probe, and the devices
# that start ranks.
RANK_SIDE = {"probe", "devices"}
# Modules of those folders that the tuner imports: they must stay free of torch too.
TUNER_SIDE_OF_PROBE = (
    "autotune.probe",
    "autotune.probe.spec",
    "autotune.probe.result",
    "autotune.probe.outcome",
    "autotune.probe.metrics",
    "autotune.probe.launcher",
    "autotune.probe.ops",
    "autotune.devices",
)
CORE = (
    "autotune",
    "autotune.api",
    "autotune.cli",
    "autotune.config",
    "autotune.units",
    "autotune.space",
    "autotune.handoff.launch",
    "autotune.models",
    "autotune.hardware",
    "autotune.estimator.memory",
    "autotune.estimator.timing",
    "autotune.estimator.plan",
    "autotune.study",
    "autotune.study.measurement",
    "autotune.study.reader",
    "autotune.search.ladder",
    "autotune.search.controller",
    "autotune.report.live",
    "autotune.report.tables",
    "autotune.report.html",
    *TUNER_SIDE_OF_PROBE,
)


def _module_level_imports(path: Path) -> set[str]:
    """Top-level package names imported at module level (outside functions and
    ``if TYPE_CHECKING:`` blocks)."""
    found: set[str] = set()

    def visit(nodes: list[ast.stmt]) -> None:
        for node in nodes:
            if isinstance(node, ast.Import):
                found.update(alias.name.split(".")[0] for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                found.add(node.module.split(".")[0])
            elif isinstance(node, ast.If):
                if "TYPE_CHECKING" not in ast.unparse(node.test):
                    visit(node.body)
                visit(node.orelse)
            elif isinstance(node, ast.Try | ast.With):
                visit(node.body)

    visit(ast.parse(path.read_text()).body)
    return found


def test_no_module_outside_the_rank_side_imports_torch_at_module_level() -> None:
    offenders = {
        str(path.relative_to(PACKAGE)): sorted(_module_level_imports(path) & set(HEAVY))
        for path in PACKAGE.rglob("*.py")
        if path.relative_to(PACKAGE).parts[0] not in RANK_SIDE
    }
    assert {k: v for k, v in offenders.items() if v} == {}


def test_the_core_and_a_simulated_search_load_no_torch(tmp_path: Path) -> None:
    """In a fresh interpreter: import the core, plan a model, tune it on the simulated GPU,
    read the study back; torch, transformers and DeepSpeed stay unloaded throughout."""
    code = f"""
import importlib, json, sys
for name in {CORE!r}:
    importlib.import_module(name)
import autotune
found = autotune.plan("llama-7b", gpu="h100-80gb", gpus=8, seq_len=4096)
assert found.rows and found.model.num_params > 6e9
summary = autotune.tune(
    "qwen2.5-1.5b", simulate="h100-80gb", gpus=1, budget="20m", global_batch=64,
    storage="sqlite:///{tmp_path}/t.db", trials_dir="{tmp_path}/trials",
)
assert summary.best is not None and summary.probes >= 1
[study] = autotune.best(model="qwen2.5-1.5b", storage="sqlite:///{tmp_path}/t.db")
assert study.best == summary.best
print(json.dumps(sorted(m for m in {HEAVY!r} if m in sys.modules)))
"""
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=False
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout.strip().splitlines()[-1]) == []


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imported(path: Path, modules: set[str]) -> set[str]:
    """The autotune modules ``path`` imports when it runs, anywhere in it (a function's
    import too: it closes a circle as surely, later), each with the packages above it (their
    ``__init__`` runs first); an ``if TYPE_CHECKING:`` block's imports, which never run, left
    out."""
    name = _module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    tree = ast.parse(path.read_text())
    typing_only = {
        id(inner)
        for node in ast.walk(tree)
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
        for statement in node.body
        for inner in ast.walk(statement)
    }
    targets: list[str] = []
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.Import):
            targets += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                above = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*above, base] if base else above)
            targets += [f"{base}.{alias.name}" for alias in node.names] + [base]
    found: set[str] = set()
    for target in targets:
        parts = target.split(".")
        for end in range(2, len(parts) + 1):
            module = ".".join(parts[:end])
            if module in modules and module != name and not name.startswith(module + "."):
                found.add(module)
    return found


def test_no_module_imports_one_that_imports_it_back() -> None:
    """autotune's import graph has no circle: each module can be read (and loaded) after
    everything it imports. Every strongly connected part of the graph (Tarjan's algorithm,
    iteratively) must be one module."""
    paths = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph = {name: _imported(path, set(paths)) for name, path in paths.items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    circles: list[list[str]] = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        while work:
            node, edges = work[-1]
            following = next(edges, None)
            if following is not None:
                if following not in index:
                    index[following] = low[following] = len(index)
                    stack.append(following)
                    work.append((following, iter(sorted(graph[following]))))
                elif following in stack:
                    low[node] = min(low[node], index[following])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                part = stack[stack.index(node) :]
                del stack[stack.index(node) :]
                if len(part) > 1:
                    circles.append(sorted(part))
    assert circles == []


ARCHITECTURE = PACKAGE.parent / "docs" / "architecture.md"


def _layers() -> list[tuple[str, list[str]]]:
    """docs/architecture.md's table of layers, bottom up, above the rank side's line: each
    layer's name and the files or folders it names (``{a,b}.py`` spelled out)."""
    lines = ARCHITECTURE.read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("| layer | modules |"))
    layers = []
    for line in lines[start + 2 :]:
        if "rank side" in line or not line.startswith("|"):
            break
        name, modules = (cell.strip() for cell in line.split("|")[1:3])
        found: list[str] = []
        for named in re.findall(r"`(autotune/[^`]+)`", modules):
            braces = re.fullmatch(r"(.*)\{(.*)\}(.*)", named)
            found += (
                [braces[1] + each.strip() + braces[3] for each in braces[2].split(",")]
                if braces
                else [named]
            )
        layers.append((name, found))
    return layers


def test_the_architecture_pages_layers_import_only_downward() -> None:
    """The table of layers on docs/architecture.md is read bottom up: no module of a layer
    imports one of a layer above it (each module in the layer naming it most closely)."""
    layers = _layers()
    paths = {_module_name(p): p for p in PACKAGE.rglob("*.py")}

    def layer(module: str) -> int | None:
        file = str(paths[module].relative_to(PACKAGE.parent))
        matches = [
            (len(named), index)
            for index, (_, names) in enumerate(layers)
            for named in names
            if file == named or (named.endswith("/") and file.startswith(named))
        ]
        return max(matches)[1] if matches else None

    upward = []
    for module, path in paths.items():
        here = layer(module)
        for imported in _imported(path, set(paths)) if here is not None else ():
            there = layer(imported)
            if there is not None and there > here:
                upward.append(f"{module} ({layers[here][0]}) -> {imported} ({layers[there][0]})")
    assert upward == []
    assert len(layers) > 20 and layer("autotune.search.ladder") is not None
