"""The ``autotune`` application: its commands' class, the consoles, the errors it prints as one
line, the helpers every command shares, and :func:`main`."""

from __future__ import annotations

import contextlib
import functools
import json
import os
import signal
import sys
import unicodedata
from collections.abc import Iterable, Iterator, Mapping
from typing import Annotated, Any

import typer
import typer.core
from rich.console import Console
from rich.markup import escape
from rich.text import Text

from autotune.config import ConfigError, NothingFits


def _plain_flags(params: list[Any]) -> list[Any]:
    """On/off options shown without a type: ``--json`` takes no value, so no ``<bool>``."""
    for param in params:
        if getattr(param, "is_flag", False) and param.metavar is None:
            param.metavar = ""
    return params


class _Command(typer.core.TyperCommand):
    def get_params(self, ctx: Any) -> list[Any]:
        return _plain_flags(super().get_params(ctx))


class _Group(typer.core.TyperGroup):
    def get_params(self, ctx: Any) -> list[Any]:
        return _plain_flags(super().get_params(ctx))


app = typer.Typer(
    cls=_Group,
    add_completion=False,
    pretty_exceptions_enable=False,
    help="OOM-driven auto-tuner for large-model training: finds the fastest configuration "
    "that fits your GPUs.",
)
command = functools.partial(app.command, cls=_Command)
"""Every command is a :class:`_Command` (its flags shown as flags)."""


def _version(value: bool) -> None:
    if not value:
        return
    from importlib import metadata

    def version(name: str) -> str:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            return "not installed"

    others = ", ".join(
        f"{n} {version(n)}" for n in ("torch", "deepspeed", "transformers", "optuna")
    )
    print(f"autotune {version('autotune')} ({others}; Python {sys.version.split()[0]})")
    raise typer.Exit(0)


@app.callback()
def _options(
    version: Annotated[
        bool,
        typer.Option(
            "--version", callback=_version, is_eager=True, help="Print the versions and exit."
        ),
    ] = False,
) -> None:
    """OOM-driven auto-tuner for large-model training: finds the fastest configuration that
    fits your GPUs."""


class _Console(Console):
    """A rich console that shows every text it is given printable
    (:func:`~autotune.report.tables.printable`): a model folder's name with an escape
    sequence in it does not clear the screen or set the window's title."""

    def render_str(self, text: str, **options: Any) -> Text:
        from autotune.report.tables import printable

        return super().render_str(printable(text), **options)


# Piped output is read by people too: do not squeeze tables into 80 columns.
console = _Console(width=None if sys.stdout.isatty() else 160)
errors = _Console(stderr=True, soft_wrap=True)


class UsageError(Exception):
    """Bad input from the user: printed as one line, exit code 2."""


def parse_sizes(text: str) -> tuple[int, ...]:
    parts = [part.strip() for part in text.split(",")]
    if not all(part.isascii() and part.isdigit() and int(part) >= 1 for part in parts):
        raise UsageError(
            f"invalid micro-batch {text!r}: use a positive integer or a list like 1,2,4"
        )
    return tuple(int(part) for part in parts)


def quiet_optuna() -> None:
    """Optuna's INFO lines (a study created or reused) would mix with the tables."""
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)


def print_json(data: object) -> None:
    print(json.dumps(data, indent=2, default=str))


def rlhf_options(
    rlhf: str | None,
    verbs: tuple[str, str],
    options: Mapping[str, object],
    others: Mapping[str, object],
    why: str = "",
) -> dict[str, Any]:
    """The RLHF ``options`` as keyword arguments, once checked: one line for one given
    without ``--rlhf`` (``--frozen plans an RL iteration: ...``), or, with it, for one of the
    ``others`` it does not take (``--loss is not planned with --rlhf: leave it out``).
    ``verbs``: what the command does with an iteration, and its past participle."""
    if rlhf is None:
        named = [name for name, value in options.items() if value is not None]
        if named:
            raise UsageError(
                f"{named[0]} {verbs[0]} an RL iteration: add --rlhf ppo or --rlhf grpo"
            )
    else:
        named = [name for name, value in others.items() if value is not None]
        if named:
            what = "use --rollout-batch" if named[0] == "--global-batch" else "leave it out"
            raise UsageError(f"{named[0]} is not {verbs[1]} with --rlhf{why}: {what}")
    return {name.lstrip("-").replace("-", "_"): value for name, value in options.items()}


def as_flags(given: Mapping[str, object], names: Iterable[str]) -> dict[str, object]:
    """The named parameters of a command under their options' names (``rollout_share`` ->
    ``--rollout-share``), for the lines that name an option."""
    return {"--" + name.replace("_", "-"): given[name] for name in names}


RLHF_OPTIONS = (
    "rollout_share",
    "sleep",
    "frozen",
    "reference",
    "critic",
    "reward",
    "rollout_batch",
    "response_len",
)
"""The options that plan an RL iteration (``probe`` takes the first six), refused without
``--rlhf``."""


SCRIPT_OPTIONS = (
    "script",
    "framework",
    "script_args",
    "batch_flag",
    "accum_flag",
    "checkpointing_flag",
)
"""The options of ``run`` and ``probe`` that name a user's script, its arguments and the flags
autotune sets in it."""


def script_options(given: Mapping[str, Any]) -> dict[str, Any]:
    """The user-script options as the API takes them, or ``{}`` where none was given (the
    command then tunes the stand-in model)."""
    named = given["script"] is not None or given["framework"] is not None
    if not named and not any(given[name] for name in SCRIPT_OPTIONS):
        return {}
    return {name: given[name] for name in SCRIPT_OPTIONS} | {
        "script_args": given["script_args"] or ()
    }


ALLOWED = ("lora",)
"""What ``--allow`` takes: trainings other than full fine-tuning."""


def allowed_lora(text: str | None) -> bool:
    """Whether ``--allow`` names LoRA; anything else it names is a usage error."""
    names = [part.strip() for part in (text or "").split(",") if part.strip()]
    unknown = [name for name in names if name not in ALLOWED]
    if unknown:
        raise ConfigError(f"--allow {unknown[0]}: use --allow {' or '.join(ALLOWED)}")
    return "lora" in names


@contextlib.contextmanager
def sigterm_interrupts() -> Iterator[None]:
    """SIGTERM (a scheduler's time limit, ``kill``) stops the run like Ctrl-C: the running
    probe is stopped and recorded, and the best so far printed."""

    def interrupt(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt("SIGTERM")

    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


PRIVATE_UMASK = 0o027
"""Bits no file or folder the command creates grants: nothing for other users, no writing
for the group (probe folders, logs, the trial database, exports and reports; the ranks
inherit it). A stricter umask of the user's stays."""


def _number_not_ascii(args: list[str]) -> str | None:
    """The first of autotune's own arguments (those before a lone ``--``: the script's are
    its own) that Python reads as a number although it is not written in ASCII (``２``, ``٣``:
    ``int`` and ``float`` take any script's digits, so ``--tp ２`` would read as 2 where
    ``--budget ５m`` is refused), or None."""
    for arg in args[: args.index("--") if "--" in args else len(args)]:
        value = arg.partition("=")[2] if arg.startswith("--") else arg
        if value.isascii():
            continue
        try:
            float(value)
        except ValueError:
            continue
        return value
    return None


def main() -> None:
    """Console entry point: one-line errors for bad input, never a traceback."""
    os.umask(os.umask(0) | PRIVATE_UMASK)
    if len(sys.argv) == 1:
        sys.argv.append("--help")  # bare ``autotune``: the help, exit 0
    number = _number_not_ascii(sys.argv[1:])
    if number is not None:
        ascii_form = "".join(str(unicodedata.digit(c, c)) for c in number)
        errors.print(
            f"error: {number!r} is a number written in other digits than ASCII's: write it "
            f"{ascii_form}",
            markup=False,
            highlight=False,
        )
        sys.exit(2)
    try:
        # Without standalone mode click returns a command's exit code instead of exiting.
        code = app(standalone_mode=False)
        sys.exit(code if isinstance(code, int) else 0)
    except typer.Exit as done:
        sys.exit(done.exit_code)
    except (typer.BadParameter, typer.Abort) as error:
        # "Invalid value for '--last': ...": the message names the option.
        message = error.format_message() if isinstance(error, typer.BadParameter) else error
        errors.print(f"[red]error:[/] {escape(str(message))}")
        sys.exit(2)
    except NothingFits as error:
        errors.print(f"[red]error:[/] {escape(str(error))}")
        sys.exit(1)
    except (UsageError, ConfigError, ValueError) as error:
        errors.print(f"[red]error:[/] {escape(str(error))}")
        sys.exit(2)
    except KeyboardInterrupt:
        errors.print("[yellow]interrupted[/]")
        sys.exit(130)
    except Exception as error:
        # Click's own usage errors (an unknown option or command, a missing value), by name:
        # typer vendors click, so its exception classes are not click's.
        if any(kind.__name__ == "ClickException" for kind in type(error).__mro__):
            format_message = getattr(error, "format_message", None)
            message = format_message() if callable(format_message) else str(error)
            names = {(c.name or c.callback.__name__) for c in app.registered_commands if c.callback}
            command = sys.argv[1] if len(sys.argv) > 1 and sys.argv[1] in names else ""
            hint = f"autotune {command} --help" if command else "autotune --help"
            errors.print(f"error: {' '.join(str(message).split())} ({hint} lists the options)",
                         markup=False, highlight=False)  # fmt: skip
            sys.exit(2)
        raise
