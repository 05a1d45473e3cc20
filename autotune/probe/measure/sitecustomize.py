"""On the ranks' ``PYTHONPATH`` when a probe runs the user's own training job.

Python imports ``sitecustomize`` at start-up in every process the job starts. Here it first
runs the ``sitecustomize`` this one hides (the interpreter's or the environment's own, if
any), then, when ``AUTOTUNE_PROBE_DIR`` is set, turns on autotune's measurement layer
(:mod:`autotune.probe.userjob`), which acts only in the process that runs the job's script.
"""

import importlib.machinery
import importlib.util
import os
import sys


def _run_hidden() -> None:
    here = os.path.dirname(os.path.abspath(__file__))
    rest = [p for p in sys.path if os.path.abspath(p or os.curdir) != here]
    found = importlib.machinery.PathFinder.find_spec("sitecustomize", rest)
    if found is None or found.loader is None or found.origin == os.path.abspath(__file__):
        return
    module = importlib.util.module_from_spec(found)
    found.loader.exec_module(module)


_run_hidden()
if os.environ.get("AUTOTUNE_PROBE_DIR"):
    try:
        from autotune.probe.userjob import install

        install()
    except Exception as error:  # the job runs on; its probe then says it was not measured
        print(f"autotune: the measurement layer did not start: {error!r}", file=sys.stderr)
