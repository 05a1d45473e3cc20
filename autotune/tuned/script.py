"""The user's own training job as the thing a probe runs (what is tuned, beside autotune's
stand-in model and an RL iteration, :mod:`autotune.tuned.rlhf`).

A :class:`ScriptJob` names the user's training script, the framework it is written for and
its own arguments; its hash makes a changed script another workload. How a measured
configuration reaches it (one adapter per framework) is :mod:`autotune.handoff.script`'s. The
secrets among the script's
arguments (a ``--db-password``'s value, a URL's password) reach the script as given, are
masked wherever the job is stored or shown (:func:`masked_args`), and are read from variables
the user sets wherever it is written as a shell script (:func:`referenced_args`). Pure
functions and plain data: nothing here imports torch.
"""

from __future__ import annotations

import dataclasses
import enum
import hashlib
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

from autotune.config import ConfigError, Engine
from autotune.urls import MASK, holds_secret, masked, redact

__all__ = [
    "BOOL_WORDS",
    "FRAMEWORK_ENGINES",
    "KNOB_FLAGS",
    "Declared",
    "Framework",
    "ScriptJob",
    "check_engines",
    "declared_flags",
    "masked_args",
    "reads_job_config",
    "recognised_flags",
    "referenced_args",
    "secret_flag",
    "shell_references",
]

BOOL_WORDS = {"true", "false", "yes", "no", "1", "0", "t", "f", "y", "n"}
"""The words a flag's value may be when it is an on/off switch, not a secret."""


class Framework(enum.StrEnum):
    """What the user's script is written for, which decides how a configuration reaches it."""

    HF = "hf"
    """A Hugging Face ``Trainer`` script whose ``TrainingArguments`` come from its command line
    (``HfArgumentParser``): its flags are rewritten."""
    ACCELERATE = "accelerate"
    """An accelerate script started by ``accelerate launch``: a generated ``--config_file``,
    the accumulation in accelerate's environment, the micro-batch through ``--batch-flag`` or
    ``autotune.job_config()``."""
    TORCHRUN = "torchrun"
    """A plain torch script started by ``torchrun``: it reads the configuration with
    ``autotune.job_config()`` (or its micro-batch flag is named with ``--batch-flag``)."""


FRAMEWORK_ENGINES: dict[Framework, tuple[Engine, ...]] = {
    Framework.HF: (Engine.SINGLE, Engine.DDP, Engine.DEEPSPEED),
    Framework.ACCELERATE: (Engine.SINGLE, Engine.DDP, Engine.DEEPSPEED),
    Framework.TORCHRUN: tuple(Engine),
}
"""The engines each adapter can hand its framework. The Trainer's and accelerate's FSDP go
through accelerate's FSDP plugin, which no test has run yet, so it is not offered."""


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


# ---- the secrets among a script's arguments ----------------------------------------------------

_SECRET_PARTS = ("password", "passwd", "passphrase", "secret", "credential")
"""A word of a flag's name that holds one of these names a secret wherever it stands
(``--db-password``, ``--dbpassword``, ``--client_secret``, ``--aws-credentials-file``)."""
_SECRET_LAST = frozenset(
    {"token", "key", "apikey", "accesskey", "privatekey", "auth", "oauth", "authorization", "pass"}
)
"""These name a secret as the last word of a flag's name (``--hub_token``, ``--api-key``,
``--hf-key``, ``--http-auth``, ``--db-pass``), as does a last word ending in ``token``
(``--hftoken``); elsewhere they name something else (``--token-id``, ``--key-column``,
``--auth-type``), and only whole words count (``--monkey``, ``--keep-last``, ``--author``,
``--max-tokens``, ``--tokenizer``)."""
_FIELD_WORDS = frozenset(
    {
        "input", "output", "label", "prompt", "chosen", "rejected", "response", "completion",
        "text", "image", "video", "audio", "sort", "dict", "column", "field", "metric",
        "primary", "partition", "group", "query", "answer", "question", "context", "message",
        "messages", "conversation", "target", "source", "reward", "data", "dataset", "cache",
        "pad", "eos", "bos", "unk", "sep", "cls", "mask", "special", "added", "start", "end",
        "stop", "max", "min", "num", "new",
    }
)  # fmt: skip
"""A word before ``key`` or ``token`` that makes the flag name a field of the data or a
special token of the tokenizer, not a secret (OpenRLHF's ``--input_key``, ``--pad_token``)."""
_NEGATIVE_NUMBER = re.compile(r"-\d+|-\d*\.\d+")
"""What argparse reads as a negative number, a value rather than a flag."""
_ASSIGNED = re.compile(r"[+~]*[A-Za-z_][\w.-]*")
"""The name of a ``name=value`` argument (Hydra's overrides: ``db.password=...``)."""
SECRET_URL_VARIABLE = "SECRET_URL"
"""The shell variable of a URL with a secret that no flag names."""


def _flag_words(name: str) -> list[str]:
    """A flag's name in lower-case words: split at anything but ASCII letters and digits,
    and where a capital follows a small letter (``--hub_Token``, ``--apiKey``, ``db.password``)."""
    spaced = re.sub(r"(?<=[a-z0-9])(?=[A-Z])", " ", name)
    return [word.lower() for word in re.split(r"[^0-9A-Za-z]+", spaced) if word]


def secret_flag(name: str) -> bool:
    """Whether the flag ``name`` (``--api-key``, ``db.password``) takes a secret, by the words
    of its name (:data:`_SECRET_PARTS`, :data:`_SECRET_LAST`)."""
    words = _flag_words(name)
    if any(part in word for word in words for part in _SECRET_PARTS):
        return True
    if not words:
        return False
    last, before = words[-1], words[-2] if len(words) > 1 else ""
    if last not in _SECRET_LAST and not last.endswith("token"):
        return False
    return last not in ("key", "token") or before not in _FIELD_WORDS


def _variable(name: str, taken: set[str], *, url: bool) -> str:
    """A shell variable for the secret of flag ``name`` (``--db-password``: ``DB_PASSWORD``;
    a URL's ends in ``_URL``, so that no flag names one the shell sets: ``--path``:
    ``PATH_URL``), one not ``taken`` yet."""
    words = _flag_words(name)
    if url and words and words[-1] != "url":
        words.append("url")
    variable = "_".join(words).upper() or SECRET_URL_VARIABLE
    if variable[0].isdigit():
        variable = f"SECRET_{variable}"
    unique, number = variable, 1
    while unique in taken:
        number += 1
        unique = f"{variable}_{number}"
    taken.add(unique)
    return unique


@dataclass(frozen=True, slots=True)
class _Secret:
    """A secret among a script's arguments."""

    index: int
    """The argument that holds it."""
    prefix: str
    """What of that argument comes before it (``--db-password=``, or nothing)."""
    value: str
    variable: str
    """The shell variable the job's shell script reads it from."""
    url: bool
    """A URL with a secret in it (a password, a secret query field), masked as a URL."""


def _is_flag(arg: str) -> bool:
    return arg.startswith("-") and arg != "-" and not _NEGATIVE_NUMBER.fullmatch(arg)


def _secrets(args: Sequence[str]) -> list[_Secret]:
    """The secrets among ``args``: the value of each flag that takes a secret (``--flag value``,
    ``--flag=value``, ``name=value``; a boolean word is none), and each URL with a secret in
    it (:func:`autotune.urls.holds_secret`)."""
    found: list[_Secret] = []
    taken: set[str] = set()

    def add(index: int, prefix: str, value: str, name: str, url: bool) -> None:
        found.append(_Secret(index, prefix, value, _variable(name, taken, url=url), url))

    index = 0
    while index < len(args):
        arg = args[index]
        name, equals, value = arg.partition("=")
        if equals and (_is_flag(arg) or _ASSIGNED.fullmatch(name)):
            if value and secret_flag(name) and value.lower() not in BOOL_WORDS:
                add(index, f"{name}=", value, name, url=False)
            elif holds_secret(value):
                add(index, f"{name}=", value, name, url=True)
        elif _is_flag(arg) and secret_flag(arg) and index + 1 < len(args):
            following = args[index + 1]
            if not _is_flag(following) and following.lower() not in BOOL_WORDS:
                add(index + 1, "", following, arg, url=False)
                index += 1
        elif holds_secret(arg):
            before = args[index - 1] if index else ""
            flag = before if _is_flag(before) and "=" not in before else ""
            add(index, "", arg, flag, url=True)
        index += 1
    return found


def masked_args(args: Sequence[str]) -> tuple[str, ...]:
    """``args`` as autotune stores and shows them: each secret ``***``, a URL with its secrets
    masked (:func:`autotune.urls.masked`); the rest as given. Masking twice changes
    nothing."""
    shown = list(args)
    for secret in _secrets(args):
        shown[secret.index] = secret.prefix + (masked(secret.value) if secret.url else MASK)
    return tuple(shown)


_REFERENCE = "\0{}\0"
"""A secret in arguments bound for :func:`shell_text`, which writes it as a reference to the
variable named between the NULs (no argument of a process holds a NUL)."""
_REFERENCE_IN_SHELL = re.compile(r"('?)\0([A-Za-z_][A-Za-z0-9_]*)\0('?)")


def referenced_args(args: Sequence[str]) -> tuple[str, ...]:
    """``args`` with each secret (a URL with a secret: the whole URL) replaced by a reference
    to a shell variable named after its flag (``--db-password``: ``DB_PASSWORD``), which
    :func:`shell_text` writes as ``"${DB_PASSWORD:?set DB_PASSWORD: ...}"``: the shell script
    stops unless the user sets it. Secrets masked already (``***``) are found the same way."""
    shown = list(args)
    for secret in _secrets(args):
        shown[secret.index] = secret.prefix + _REFERENCE.format(secret.variable)
    return tuple(shown)


def shell_references(text: str) -> str:
    """``text``, shell quoted by ``shlex`` (every word with a NUL in single quotes), with each
    reference of :func:`referenced_args` written as the shell's: the single quotes around it
    closed and reopened, the variable double-quoted, the shell stopped when it is unset."""

    def reference(found: re.Match[str]) -> str:
        opened, variable, closed = found.groups()
        expansion = f'"${{{variable}:?set {variable}: autotune keeps no secrets}}"'
        return ("" if opened else "'") + expansion + ("" if closed else "'")

    return _REFERENCE_IN_SHELL.sub(reference, text)


KNOB_FLAGS: Mapping[str, tuple[str, str, str]] = {
    "batch": ("--batch-flag", "--batch-size", "--per_device_train_batch_size"),
    "accum": ("--accum-flag", "--grad-accum", "--gradient_accumulation_steps"),
    "checkpointing": (
        "--checkpointing-flag",
        "--activation-checkpointing",
        "--activation_checkpointing",
    ),
}
"""Each knob a script's own flag may carry: autotune's option that names the flag, an
example, and the Trainer's field for it (the Trainer's flags are known)."""


NO_FLAG = "none"
"""What ``--batch-flag``, ``--accum-flag`` or ``--checkpointing-flag`` take to say the script
has no such flag (none is then looked for in its source)."""

_COMMON_FLAGS: Mapping[str, frozenset[str]] = {
    "batch": frozenset(
        {
            "batch-size", "micro-batch-size", "micro-batch", "mbs", "per-device-batch-size",
            "per-device-train-batch-size", "train-micro-batch-size", "local-batch-size",
        }
    ),
    "accum": frozenset(
        {
            "grad-accum", "grad-accum-steps", "gradient-accumulation-steps",
            "gradient-accumulation", "accumulation-steps", "accum-steps",
            "grad-accumulation-steps",
        }
    ),
    "checkpointing": frozenset(
        {
            "activation-checkpointing", "gradient-checkpointing", "checkpointing",
            "grad-ckpt", "activation-ckpt",
        }
    ),
}  # fmt: skip
"""The flag names autotune recognises for each knob, written with dashes and in lower case
(``--grad_accum`` is ``grad-accum``)."""


class Declared(NamedTuple):
    """One option a script declares: its ``action`` (None: it takes a value) and which
    ``add_argument`` call declared it (aliases share one: ``"--mbs", "--micro-batch-size"``)."""

    action: str | None
    call: int


def declared_flags(source: str) -> dict[str, Declared]:
    """The options an argparse script declares in its own source (each literal option of an
    ``add_argument`` call), read by Python's own grammar without running the script; empty
    for a file that is not Python."""
    import ast

    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return {}
    found: dict[str, Declared] = {}
    calls = (
        node
        for node in ast.walk(tree)
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr == "add_argument"
    )
    for call, node in enumerate(calls):
        action = next(
            (
                kw.value.value
                for kw in node.keywords
                if kw.arg == "action" and isinstance(kw.value, ast.Constant)
            ),
            None,
        )
        for arg in node.args:
            if (
                isinstance(arg, ast.Constant)
                and isinstance(arg.value, str)
                and arg.value.startswith("-")
            ):
                found[arg.value] = Declared(action if isinstance(action, str) else None, call)
    return found


def reads_job_config(source: str) -> bool:
    """Whether a script calls ``job_config()`` (``autotune.job_config()``): it then takes its
    configuration from autotune, and its own flags are not looked for."""
    import ast

    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return False
    return any(
        isinstance(node, ast.Call)
        and (
            (isinstance(node.func, ast.Attribute) and node.func.attr == "job_config")
            or (isinstance(node.func, ast.Name) and node.func.id == "job_config")
        )
        for node in ast.walk(tree)
    )


def recognised_flags(declared: Mapping[str, Declared]) -> dict[str, str]:
    """The knob each of ``declared``'s options carries by its common name
    (:data:`_COMMON_FLAGS`): a value-taking option for the micro-batch and the accumulation,
    a ``store_true`` switch for checkpointing. Aliases of one option (one ``add_argument``)
    are one candidate, set by its first spelling; a knob two options could carry has none."""
    found: dict[str, str] = {}
    for knob, names in _COMMON_FLAGS.items():
        switch = knob == "checkpointing"
        matches = {
            option: seen.call
            for option, seen in declared.items()
            if option.lstrip("-").lower().replace("_", "-") in names
            and (seen.action == "store_true" if switch else seen.action in (None, "store"))
        }
        if len(set(matches.values())) == 1:
            found[knob] = next(iter(matches))
    return found


@dataclass(frozen=True, kw_only=True, slots=True)
class ScriptJob:
    """The user's training script, its framework and its own arguments."""

    framework: Framework
    path: str
    """The script, as an absolute path."""
    args: tuple[str, ...] = ()
    """The script's own arguments (what follows ``--`` on autotune's command line)."""
    sha256: str = ""
    """The script's content hash: a changed script is a changed workload (another study)."""
    batch_flag: str | None = None
    """The script's own flag for the per-rank micro-batch (``--batch-size``), which the
    accelerate and torchrun adapters set; None: the script reads ``autotune.job_config()``
    (the Trainer's flags are known)."""
    accum_flag: str | None = None
    """The script's own flag for the micro-steps per optimizer step (``--grad-accum``), set
    as the batch flag is; None: the script reads ``autotune.job_config()`` (or, under
    accelerate, accelerate's own setting)."""
    checkpointing_flag: str | None = None
    """The script's own switch that checkpoints every decoder block (argparse's
    ``store_true``, ``--activation-checkpointing``): given where a configuration checkpoints,
    left out (with any ``--no-`` form) where it does not. A switch has no every-k-th-block
    setting, so those configurations are not tried."""
    checkpoints: bool = True
    """Whether the job can checkpoint its blocks; False: a script with no checkpointing switch
    (none declared under a name autotune recognises, or ``--checkpointing-flag none``) that
    does not read ``autotune.job_config()`` either: its search leaves every configuration that
    checkpoints out."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "framework", Framework(self.framework))
        object.__setattr__(self, "args", tuple(self.args))

    @classmethod
    def read(
        cls,
        path: str | Path,
        framework: Framework | str,
        args: Sequence[str] = (),
        batch_flag: str | None = None,
        *,
        accum_flag: str | None = None,
        checkpointing_flag: str | None = None,
        recognise: bool = False,
    ) -> ScriptJob:
        """The job of the script at ``path``, checked: it exists and is a Python file,
        ``framework`` is one autotune has an adapter for, and each flag named for a knob is a
        flag, one knob's only, of a framework whose flags autotune does not know already.

        ``recognise``: a knob whose flag is not named takes the option the script declares
        for it under a common name (:func:`recognised_flags`: ``--batch-size``,
        ``--grad-accum``, a ``--gradient-checkpointing`` switch), as :func:`declared_flags`
        reads the script's source, unless the script reads ``autotune.job_config()``;
        :data:`NO_FLAG` (``none``) names no flag and looks for none."""
        script = Path(path).expanduser()
        if not script.is_file():
            raise ConfigError(
                f"the script {path} does not exist: give --script the path of your training "
                "script, like --script train.py"
            )
        try:
            kind = Framework(str(framework))
        except ValueError:
            choices = ", ".join(f.value for f in Framework)
            raise ConfigError(
                f"unknown framework {framework!r}: use --framework {choices}"
            ) from None
        try:
            digest = _sha256(script)
        except OSError as error:
            raise ConfigError(
                f"the script {path} cannot be read ({error.strerror}): check its permissions"
            ) from None
        given: dict[str, str | None] = {
            "batch": batch_flag,
            "accum": accum_flag,
            "checkpointing": checkpointing_flag,
        }
        source: str | None = None
        if kind is not Framework.HF and (
            checkpointing_flag == NO_FLAG or (recognise and None in given.values())
        ):
            try:
                source = script.read_text(errors="replace")
            except OSError:
                source = ""
        if recognise and source is not None and None in given.values():
            found = {} if reads_job_config(source) else recognised_flags(declared_flags(source))
            for knob, option in found.items():
                if given[knob] is None and option not in given.values():
                    given[knob] = option
        given = {k: None if v == NO_FLAG else v for k, v in given.items()}
        # No switch of its own (none declared, or disowned with `none`) and no
        # autotune.job_config() to read ac_every from: the job cannot checkpoint.
        checkpoints = not (
            given["checkpointing"] is None and source is not None and not reads_job_config(source)
        )
        for knob, flag in given.items():
            if flag is None:
                continue
            option, example, trainer = KNOB_FLAGS[knob]
            if not re.fullmatch(r"--?[A-Za-z][\w.-]*", flag):
                raise ConfigError(
                    f"{option} {flag!r} is not a flag: name the script's own, like "
                    f"{option} {example}"
                )
            if kind is Framework.HF:
                raise ConfigError(
                    f"{option} with --framework hf: the Trainer's {trainer} is set already; "
                    "leave it out"
                )
        named = [flag for flag in given.values() if flag is not None]
        if len(set(named)) < len(named):
            raise ConfigError(
                "one flag named for two knobs (--batch-flag, --accum-flag, "
                "--checkpointing-flag): name each knob's own flag"
            )
        return cls(
            framework=kind,
            path=str(script.resolve()),
            args=tuple(args),
            sha256=digest,
            batch_flag=given["batch"],
            accum_flag=given["accum"],
            checkpointing_flag=given["checkpointing"],
            checkpoints=checkpoints,
        )

    @property
    def name(self) -> str:
        """The script's file name."""
        return Path(self.path).name

    @property
    def key(self) -> str:
        """Short and stable: ``train.py@hf:1a2b3c4d``, the last part a hash of the script's
        content and its arguments as stored, secrets masked (the study's name carries it:
        another script, or other arguments, are another study; another password is not)."""
        parts: tuple[str, ...] = (self.sha256, self.batch_flag or "", *masked_args(self.args))
        if self.accum_flag or self.checkpointing_flag:  # a job without them keeps its key
            parts += ("", self.accum_flag or "", self.checkpointing_flag or "")
        if not self.checkpoints:  # another search space: another study
            parts += ("", "no-checkpointing")
        identity = hashlib.sha256("\0".join(parts).encode()).hexdigest()
        return f"{self.name}@{self.framework.value}:{identity[:8]}"

    def to_dict(self) -> dict[str, Any]:
        """The job as stored and shown (a study's fingerprint, a probe's ``config.json`` and
        ``result.json``): its arguments' secrets masked (:func:`masked_args`). The running
        script gets the real ones from the job itself, never from this."""
        return {
            "framework": self.framework.value,
            "path": self.path,
            "args": list(masked_args(self.args)),
            "sha256": self.sha256,
            "batch_flag": self.batch_flag,
            "accum_flag": self.accum_flag,
            "checkpointing_flag": self.checkpointing_flag,
            # Said only where it is not the default: a job's stored fingerprint stays as it was.
            **({} if self.checkpoints else {"checkpoints": False}),
        }

    def for_shell(self) -> ScriptJob:
        """The job as a shell script writes it: each secret among its arguments a reference
        to a variable the user sets (:func:`referenced_args`)."""
        return dataclasses.replace(self, args=referenced_args(self.args))

    def redact(self, text: str) -> str:
        """``text`` (the job's last lines of output) without the secrets of its arguments."""
        for secret in sorted(_secrets(self.args), key=lambda s: len(s.value), reverse=True):
            text = redact(text, secret.value) if secret.url else text.replace(secret.value, MASK)
        return text

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ScriptJob:
        return cls(
            framework=Framework(data["framework"]),
            path=str(data["path"]),
            args=tuple(data.get("args") or ()),
            sha256=str(data.get("sha256") or ""),
            batch_flag=data.get("batch_flag"),
            accum_flag=data.get("accum_flag"),
            checkpointing_flag=data.get("checkpointing_flag"),
            checkpoints=bool(data.get("checkpoints", True)),
        )


def check_engines(job: ScriptJob, engines: Sequence[Engine]) -> None:
    """Refuse an engine the job's adapter cannot hand its framework (one line)."""
    allowed = FRAMEWORK_ENGINES[job.framework]
    bad = [e for e in engines if e not in allowed]
    if bad:
        raise ConfigError(
            f"--framework {job.framework.value} cannot run engine {bad[0].value}: use "
            f"--engine {' or '.join(e.value for e in allowed)}"
        )
