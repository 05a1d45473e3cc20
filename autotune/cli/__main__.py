"""``python -m autotune.cli``: the ``autotune`` command."""

from autotune.cli import main

main()
