"""``python -m autotune.probe.ops build [--dir DIR] [--wait SECONDS] OP [OP ...]``: build the
DeepSpeed ops that are not built yet, under the build lock, printing each op and its time.

Exit status: 0 when every op is built (or not used by DeepSpeed's accelerator here), 1 when a
build failed, 2 for an unknown op, 3 when another live process held the build lock for longer
than ``--wait``. The last line of the output says what happened, in one line.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from autotune.probe.lifetime import PARENT_ENV, die_with_parent
from autotune.probe.ops import (
    ARCH_LIST_ENV,
    BUILD_WAIT_S,
    BUILDERS,
    EXTENSIONS_ENV,
    BuildLockTimeout,
    extensions_dir,
    load_ops,
    op_environment,
    pending_ops,
)


def _build(ops: list[str], directory: Path, wait_s: float) -> int:
    """The build step: set up the environment, skip what is built, build the rest."""
    unknown = [op for op in ops if op not in BUILDERS]
    if unknown:
        print(f"error: unknown op {', '.join(unknown)}: known are {', '.join(BUILDERS)}")
        return 2
    todo = pending_ops(ops, directory)
    if not todo:
        print(f"nothing to build: {', '.join(ops)} built in {directory}")
        return 0
    env = op_environment({**os.environ, EXTENSIONS_ENV: str(directory)})
    for name in (EXTENSIONS_ENV, ARCH_LIST_ENV, "PATH"):
        if name in env:
            os.environ[name] = env[name]
        else:
            os.environ.pop(name, None)
    print(f"building DeepSpeed ops in {directory}: {', '.join(todo)}", flush=True)
    try:
        loads = load_ops(todo, directory, wait_s=wait_s, say=lambda s: print(s, flush=True))
    except BuildLockTimeout as error:
        print(f"error: {error}")
        return 3
    except Exception as error:
        import traceback

        traceback.print_exc()
        detail = " ".join(str(error).split())[:300]
        print(f"error: building {', '.join(todo)} failed: {type(error).__name__}: {detail}")
        return 1
    print(", ".join(load.line() for load in loads))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m autotune.probe.ops",
        description="Build DeepSpeed's JIT ops once, outside any probe.",
    )
    commands = parser.add_subparsers(dest="command", required=True)
    build = commands.add_parser("build", help="build the ops that are not built yet")
    build.add_argument("ops", nargs="+", metavar="OP", help=f"one of {', '.join(BUILDERS)}")
    build.add_argument(
        "--dir",
        type=Path,
        default=None,
        help="extensions folder (default: $TORCH_EXTENSIONS_DIR, else "
        "<sys.prefix>/torch_extensions)",
    )
    build.add_argument(
        "--wait",
        type=float,
        default=BUILD_WAIT_S,
        help="seconds to wait for another process's build before giving up",
    )
    args = parser.parse_args(argv)
    parent = os.environ.get(PARENT_ENV)
    die_with_parent(int(parent) if parent else None)  # started by a tuner: end with it
    directory = args.dir if args.dir is not None else extensions_dir(os.environ)
    return _build(list(args.ops), directory.resolve(), args.wait)


if __name__ == "__main__":
    sys.exit(main())
