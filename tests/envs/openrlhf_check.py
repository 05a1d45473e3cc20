"""OpenRLHF's own argument parser and checks of ``python -m openrlhf.cli.train_ppo_ray
FLAGS...`` command lines, run in OpenRLHF's environment (``tests/envs/frameworks.sh openrlhf``).

``openrlhf.cli.train_ppo_ray`` builds its parser and checks the arguments in its
``if __name__ == "__main__":`` block, then calls ``train(args)``, which asserts that the GPUs
of colocated roles agree before it places them with Ray. The module imports Ray and vLLM at
its top, which need GPUs, so it is not imported: its source, from the installed package, is
read with ``ast`` and run in parts, unchanged:

- its top-level imports, each on its own; those that need Ray or vLLM fail and are left out
  (the parser and the checks use none of their names: one they did use would fail the check
  with a NameError);
- ``train`` reduced to its checks: every ``assert`` with the ``if`` statements around it, the
  rest (Ray, the engines, the trainer) dropped;
- the ``__main__`` block, as is: the parser reads the flags, OpenRLHF's checks run, then the
  reduced ``train(args)``.

Reads a JSON list of command lines (each the list of arguments after ``python``) on stdin;
writes a JSON list, one object a command line: ``{"error": "..."}`` with argparse's message (an
unknown flag, a bad value) or OpenRLHF's failed check, else ``{"args": ...}``, the parsed
arguments as OpenRLHF's nested namespace.
"""

from __future__ import annotations

import ast
import contextlib
import copy
import importlib.util
import io
import json
import sys
from types import CodeType, SimpleNamespace
from typing import Any

MODULE = "openrlhf.cli.train_ppo_ray"


def _is_main_block(node: ast.stmt) -> bool:
    return (
        isinstance(node, ast.If)
        and isinstance(node.test, ast.Compare)
        and isinstance(node.test.left, ast.Name)
        and node.test.left.id == "__name__"
    )


def _checks_only(body: list[ast.stmt]) -> list[ast.stmt]:
    """The ``assert`` statements of ``body`` with the ``if`` statements that hold them."""
    kept: list[ast.stmt] = []
    for node in body:
        if isinstance(node, ast.Assert):
            kept.append(node)
        elif isinstance(node, ast.If):
            inner, other = _checks_only(node.body), _checks_only(node.orelse)
            if inner or other:
                kept.append(ast.If(test=node.test, body=inner or [ast.Pass()], orelse=other))
    return kept


def _plain(value: Any) -> Any:
    if isinstance(value, SimpleNamespace):
        return {key: _plain(item) for key, item in vars(value).items()}
    if isinstance(value, list | tuple):
        return [_plain(item) for item in value]
    return value


def load() -> tuple[CodeType, dict[str, Any], str]:
    """The module's checks, compiled, its namespace after its imports, and its file."""
    spec = importlib.util.find_spec(MODULE)
    assert spec is not None and spec.origin is not None, f"{MODULE} is not installed"
    with open(spec.origin, encoding="utf-8") as source:
        tree = ast.parse(source.read(), spec.origin)
    namespace: dict[str, Any] = {"__name__": "__main__", "__file__": spec.origin}
    for node in tree.body:
        if isinstance(node, ast.Import | ast.ImportFrom):
            try:
                exec(compile(ast.Module([node], []), spec.origin, "exec"), namespace)
            except ImportError as missing:
                print(f"left out: {ast.unparse(node)} ({missing})", file=sys.stderr)
    [train] = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "train"]
    [block] = [n for n in tree.body if _is_main_block(n)]
    checks = copy.copy(train)
    checks.body = _checks_only(train.body)
    assert checks.body, f"{MODULE}.train holds no assert: the check would check nothing"
    assert isinstance(block, ast.If)
    module = ast.fix_missing_locations(ast.Module([checks, *block.body], []))
    return compile(module, spec.origin, "exec"), namespace, spec.origin


def check(code: CodeType, imported: dict[str, Any], origin: str, argv: list[str]) -> dict:
    if argv[:2] != ["-m", MODULE]:
        return {"error": f"not a {MODULE} command line: {argv[:2]}"}
    namespace = dict(imported)
    sys.argv = [origin, *argv[2:]]
    said = io.StringIO()
    try:
        with contextlib.redirect_stderr(said):
            exec(code, namespace)
    except SystemExit:  # argparse's refusal
        return {"error": said.getvalue().strip().splitlines()[-1]}
    except AssertionError as refused:
        return {"error": f"AssertionError: {refused}"}
    return {"args": _plain(namespace["args"])}


def main() -> int:
    commands = json.load(sys.stdin)
    with contextlib.redirect_stdout(sys.stderr):
        code, imported, origin = load()
        results = [check(code, imported, origin, argv) for argv in commands]
    json.dump(results, sys.stdout, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
