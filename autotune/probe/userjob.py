"""The measurement layer of a user's training job: one rank of a probe that runs the user's
own script instead of autotune's stand-in.

The user does not import it. The launcher puts ``autotune/probe/measure`` first on the
ranks' ``PYTHONPATH``; its ``sitecustomize`` calls :func:`install` in every Python process the
job starts, which turns the layer on only in the process that runs the job's script (not in
``torchrun``'s or accelerate's launcher, nor in data-loader workers). It then watches, through
torch's global hooks only:

- **steps**: the global optimizer-step hooks see every ``torch.optim.Optimizer`` subclass
  (DeepSpeed's inner optimizers included). A step ends when the next micro-step's forward
  begins, so several inner ``step`` calls of one optimizer step (ZeRO-3's sub-groups) count once
  and the step's collectives are done on every rank before this one stops.
- **tokens**: the token ids fed to the model's token embedding (the ``nn.Embedding`` with the
  most rows called on integer ids while training): their batch and sequence sizes are checked
  against what the probe asked, so a script that ignores the batch flags is caught.
- **engine**: the modules whose forward runs when a micro-step's token ids reach the
  embedding (read from the interpreter's frames: each module call runs through
  ``Module._call_impl``), outermost first; the first that is an engine's wrapper is the
  engine that trained (:func:`wrapper_of`). It must be the one the probe asked for
  (:meth:`Layer._engine_problem`), so a script that wraps its model its own way is refused
  with one line, not recorded as the engine autotune asked for.
- **memory**: the same readings as the worker (the CUDA allocator's peak, or on the CPU the
  live tensor bytes under the emulated cap, which raises a real ``torch.OutOfMemoryError``),
  reset when training begins: loading the model is not the peak of a step.
- **failures**: an uncaught exception is reported with its type and the stage it hit (build,
  forward, backward, optimizer); a script that ends before the probe's steps are done says how
  many it ran.

Before the script runs, on the CPU, the layer loads the DeepSpeed ops the job's engine will
load (:func:`~autotune.probe.ops.deepspeed_ops`: the shared-memory communication op) under
autotune's build lock, building one the set-up step did not; DeepSpeed's own loads in the
script then reuse them, so the script takes no torch build lock outside autotune's (one a
killed script left would stop every later load of the op). On a GPU the set-up step builds
the job's Adam op before the probe, and the layer touches no CUDA before the script does.

After the warm-up and timed steps it writes the same ``rank<N>.json`` as the worker and ends the
process, so ``classify_probe``, the study and the search read it as any probe.

The report is the layer's, not the script's: before the script runs, the layer takes the rank's
token (:data:`~autotune.probe.result.TOKEN_FILE`: read, then deleted) and signs every write of
the report with it. The launcher takes a job's report only with the right signature, and its
measured sizes only as the timed steps the probe asked for
(:func:`~autotune.probe.result.job_report_problem`). Once the script runs, the token is in no
file and no environment it can read; what this guards against is a report the script writes
(or copies from another run), not code that reads the layer's own objects in its process.
The layer's process is a child subreaper (:func:`~autotune.probe.lifetime.adopt_orphans`), and
ends what the job started when it ends.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import json
import os
import runpy
import statistics
import sys
import time
import traceback
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from autotune.config import Engine, LossDtype, TrainConfig
from autotune.probe.lifetime import adopt_orphans, end_descendants
from autotune.probe.ops import deepspeed_ops, extensions_dir, load_ops
from autotune.probe.outcome import Outcome, Stage, is_oom_error
from autotune.probe.report import RankReport
from autotune.probe.result import JOB_MISTAKE, SIGNATURE, TOKEN_FILE, report_signature
from autotune.probe.spec import ProbeSpec
from autotune.tuned.script import Framework, ScriptJob


def _held_clock() -> Callable[[], float]:
    """The monotonic clock as the layer loads it, before any of the job's code runs, held in a
    closure: a job that replaces ``time.perf_counter`` (a prelude's slow clock), or a library
    that freezes time in tests (freezegun, which also swaps every module attribute that is one
    of time's functions for its fake), changes what ``time.perf_counter`` names, not this."""
    clock = time.perf_counter
    return lambda: clock()


_CLOCK = _held_clock()
"""The clock every step of the job is timed with."""

PROBE_DIR_ENV = "AUTOTUNE_PROBE_DIR"
"""The probe folder of the run the layer measures (its ``config.json`` is the spec)."""

_OPTIONS_WITH_VALUE = {"-W", "-X", "-Q"}

DATA_MIN_BYTES = 1 << 20
"""The smallest integer storage the CPU's emulated device takes for a job's in-memory data
(:meth:`Layer._set_data_aside`): a model's integer buffers and a micro-batch's ids stay
below it or are told apart."""


def runs_script(job: ScriptJob, argv: list[str]) -> bool:
    """Whether an interpreter started with ``argv`` (``sys.orig_argv``) runs the job's script."""
    index = 1
    while index < len(argv):
        arg = argv[index]
        if arg in _OPTIONS_WITH_VALUE:
            index += 2
            continue
        if arg in ("-c", "-m") or arg == "-":
            return False
        if arg.startswith("-"):
            index += 1
            continue
        return os.path.realpath(arg) == os.path.realpath(job.path)
    return False


def _batch_hint(job: ScriptJob) -> str:
    if job.framework is Framework.HF:
        return "does it read --per_device_train_batch_size and --gradient_accumulation_steps?"
    if "transformers.trainer" in sys.modules:  # the job's process imported the Trainer
        return "it trains with a Hugging Face Trainer: give --framework hf"
    own = [
        f"{option} {flag}"
        for option, flag in (("--batch-flag", job.batch_flag), ("--accum-flag", job.accum_flag))
        if flag
    ]
    if own:
        return f"does it take them from {' and '.join(own)}, or autotune.job_config()?"
    return (
        "does it take them from autotune.job_config()? (a script with flags of its own for "
        "them: name each with --batch-flag and --accum-flag)"
    )


@dataclass(frozen=True, slots=True)
class Wrapper:
    """The engine that trained the model, as the layer saw it."""

    engine: Engine
    """The autotune engine it is (``single``: no wrapper)."""
    name: str
    """How it is said: ``DDP (torch's DistributedDataParallel)``."""
    zero_stage: int | None = None
    """DeepSpeed's ZeRO stage (its engine's own ``zero_optimization_stage()``)."""

    def matches(self, config: TrainConfig, world_size: int) -> bool:
        """Whether it is the engine ``config`` asks for. One rank: DDP and no wrapper count
        alike (a lone rank's DDP exchanges nothing; frameworks differ on wrapping it). FSDP1
        counts as ``fsdp`` where it shards (any strategy but ``NO_SHARD``, which is DDP's
        replication): the Trainer and accelerate pick FSDP1 or FSDP2 by their version and
        configuration. DeepSpeed's ZeRO stage must be the one asked; FSDP's reshard mode is
        not checked (FSDP2's modules do not say it publicly)."""
        asked = config.engine
        if asked in (Engine.SINGLE, Engine.DDP) and world_size == 1:
            return self.engine in (Engine.SINGLE, Engine.DDP)
        if self.engine is not asked:
            return False
        return asked is not Engine.DEEPSPEED or self.zero_stage == config.zero_stage


def _loaded_class(module: str, name: str) -> type | None:
    """Class ``name`` of ``module`` if that module is imported (no instance exists otherwise)."""
    found = getattr(sys.modules.get(module), name, None)
    return found if isinstance(found, type) else None


def wrapper_of(chain: list[Any]) -> Wrapper:
    """The engine that trains, from the modules whose forward runs at a micro-step, outermost
    first: the first of them that is DeepSpeed's engine, DDP (or torch's composable
    ``replicate``), FSDP2 (a module ``fully_shard`` made an ``FSDPModule``: the root, when
    the job shards it as FSDP2 requires) or FSDP1; no wrapper otherwise."""
    import torch

    deepspeed = _loaded_class("deepspeed.runtime.engine", "DeepSpeedEngine")
    replicated = [
        torch.nn.parallel.DistributedDataParallel,
        _loaded_class("torch.distributed._composable.replicate", "DDP"),
        _loaded_class("torch.distributed._composable.replicate_with_fsdp", "ReplicateModule"),
    ]
    fsdp2 = _loaded_class("torch.distributed.fsdp", "FSDPModule")
    fsdp1 = _loaded_class("torch.distributed.fsdp", "FullyShardedDataParallel")
    for module in chain:
        if deepspeed is not None and isinstance(module, deepspeed):
            engine: Any = module
            stage = int(engine.zero_optimization_stage())
            return Wrapper(Engine.DEEPSPEED, f"DeepSpeed's engine at ZeRO stage {stage}", stage)
        if any(kind is not None and isinstance(module, kind) for kind in replicated):
            return Wrapper(Engine.DDP, f"DDP (torch's {type(module).__name__})")
        if fsdp2 is not None and isinstance(module, fsdp2):
            return Wrapper(Engine.FSDP, "FSDP2 (fully_shard)")
        if fsdp1 is not None and isinstance(module, fsdp1):
            strategy = getattr(getattr(module, "sharding_strategy", None), "name", "")
            if strategy == "NO_SHARD":
                return Wrapper(Engine.DDP, "FSDP1 with NO_SHARD (replicated, as DDP)")
            return Wrapper(Engine.FSDP, f"FSDP1 (FullyShardedDataParallel, {strategy})")
    outer = type(chain[0]).__name__ if chain else "the model"
    return Wrapper(Engine.SINGLE, f"no wrapper ({outer} called as it is)")


def _asked_engine(config: TrainConfig, world_size: int) -> str:
    if config.engine is Engine.DEEPSPEED:
        return f"engine deepspeed at ZeRO stage {config.zero_stage}"
    if config.engine is Engine.DDP:
        return f"engine ddp over {world_size} ranks"
    return f"engine {config.engine.value}"


def _engine_hint(job: ScriptJob, engine: Engine) -> str:
    if job.framework is Framework.HF:
        return "does the script pass its TrainingArguments to the Trainer as given?"
    if job.framework is Framework.ACCELERATE:
        return "does it wrap the model with accelerator.prepare under accelerate launch's config?"
    how = {
        Engine.SINGLE: "leave its model unwrapped",
        Engine.DDP: "wrap its model in DistributedDataParallel",
        Engine.FSDP: "apply fully_shard to each decoder block, then to the model",
        Engine.DEEPSPEED: "call deepspeed.initialize with config=autotune.job_config().deepspeed",
    }[engine]
    return f"does it {how} when autotune.job_config().engine is {engine.value!r}?"


def take_token(probe_dir: Path, rank: int) -> str | None:
    """The rank's token, read and then deleted, so the job's script, which runs after, finds
    it nowhere; None where the launcher wrote none (a run by hand, from ``cmd.txt``)."""
    path = probe_dir / TOKEN_FILE.format(rank)
    try:
        token = path.read_text().strip()
    except OSError:
        return None
    with contextlib.suppress(OSError):
        path.unlink()
    return token or None


class SignedReport(RankReport):
    """The rank's report, signed with the rank's token at every write (unsigned without one)."""

    def __init__(self, path: Path, rank: int, world_size: int, token: str | None) -> None:
        super().__init__(path, rank, world_size)
        self._token = token

    def write(self) -> None:
        if self._token is None:
            super().write()
            return
        data = json.loads(json.dumps(self.data, default=str))  # as the launcher reads it
        data[SIGNATURE] = report_signature(data, self._token)
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(data, indent=2))
        os.replace(tmp, self.path)


@dataclass
class _Step:
    """One optimizer step as the hooks saw it."""

    began: float
    """When its first micro-step's forward began (the previous step's end)."""
    optimizer_began: float = 0.0
    ended: float = 0.0
    micro_steps: int = 0
    shapes: list[tuple[int, ...]] = field(default_factory=list)
    """The token ids' shape of each micro-step."""
    checkpoints: int = 0
    """Calls of ``torch.utils.checkpoint.checkpoint`` in its forwards (checkpointed blocks)."""
    losses: list[float] = field(default_factory=list)
    wrappers: list[Wrapper] = field(default_factory=list)
    """The engine that ran each micro-step's forward."""


class Layer:
    """The hooks of one rank, and its report."""

    def __init__(self, probe_dir: Path, spec: ProbeSpec) -> None:
        import torch

        from autotune.models import resolve_model
        from autotune.probe.memory import LiveTensorBytes, MemoryMeter, apply_cuda_limit

        assert spec.script is not None
        self.torch = torch
        self.spec = spec
        self.job = spec.script
        self.model = resolve_model(spec.model)
        self.rank = int(os.environ.get("RANK", "0"))
        self.world_size = int(os.environ.get("WORLD_SIZE", "1"))
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        token = take_token(probe_dir, self.rank)
        self.report = SignedReport(
            probe_dir / f"rank{self.rank}.json", self.rank, self.world_size, token
        )
        spawned = float(os.environ.get("AUTOTUNE_SPAWN_TIME") or time.time())
        self.report.update(import_s=time.time() - spawned)
        kind = spec.device
        if kind == "auto":
            kind = "cuda" if torch.cuda.is_available() else "cpu"
        self.device = torch.device("cuda", local_rank) if kind == "cuda" else torch.device("cpu")
        tracker = None
        if self.device.type == "cuda":
            if spec.device_memory_bytes is not None:
                apply_cuda_limit(spec.device_memory_bytes, self.device)
        else:
            tracker = LiveTensorBytes(spec.device_memory_bytes)
            tracker.__enter__()  # for the life of the process: the job's tensors are counted
            # The threads the launcher gave this rank (a fork of the warm process has the
            # warm process's thread pool, sized for the whole machine).
            threads = os.environ.get("OMP_NUM_THREADS", "")
            if threads.isdigit() and int(threads) > 0:
                torch.set_num_threads(int(threads))
        self.meter = MemoryMeter(
            device=self.device, tracker=tracker, emulated_limit_bytes=spec.device_memory_bytes
        )
        self.stage = Stage.BUILD
        self.vocab_rows = 0
        """Rows of the largest embedding fed token ids so far: the token embedding."""
        self.loss_dtype: LossDtype | None = None
        """The :class:`~autotune.config.LossDtype` the job's loss took the logits in (its
        last training call over the vocabulary); None: not seen (:meth:`_watch_loss`)."""
        self._last_ids: Any = None
        """The token ids of the micro-step beginning (while :meth:`_micro_step` runs)."""
        self.host_data_bytes = 0
        """Bytes of the job's in-memory data the CPU's emulated device no longer counts."""
        self.steps: list[_Step] = []
        self.current: _Step | None = None
        self.done = False
        self.optimizers: set[str] = set()
        """The optimizer classes whose steps were seen (the job's engine shows in them)."""
        self.joined: int | None = None
        """The size of the process group this rank trained in (at its first step)."""
        self.began = time.time()
        self.report.update(device=str(self.device), startup_s=self.began - spawned)

    # ---- hooks ------------------------------------------------------------------------------

    def install(self) -> None:
        from torch.nn.modules import module as nn_module
        from torch.optim import optimizer

        self._load_ops()
        nn_module.register_module_forward_pre_hook(self._pre_forward)
        nn_module.register_module_forward_hook(self._post_forward)
        optimizer.register_optimizer_step_pre_hook(self._pre_step)
        optimizer.register_optimizer_step_post_hook(self._post_step)
        self._count_checkpoints()
        self._watch_loss()
        self._watch_backward()
        previous = sys.excepthook

        def excepthook(kind: Any, error: BaseException, tb: Any) -> None:
            self.failed(error, "".join(traceback.format_exception(kind, error, tb)))
            previous(kind, error, tb)

        sys.excepthook = excepthook
        atexit.register(self.ended)
        adopt_orphans()  # a daemon the job starts stays below this process, which ends it

    def _load_ops(self) -> None:
        """Load the DeepSpeed ops the job's engine will load on the CPU, under autotune's
        build lock, before the script runs (the module's docstring says why). A load that
        fails is the probe's failure, said in one line, and the script does not run."""
        if self.device.type != "cpu":
            return
        ops = deepspeed_ops(self.spec.config, "cpu")
        if not ops:
            return

        def say(line: str) -> None:
            print(f"autotune: {line}", flush=True)

        try:
            # No bound of its own: the probe's timeout bounds the wait.
            loads = load_ops(ops, extensions_dir(os.environ), wait_s=None, say=say)
        except Exception as error:
            self.failed(error, traceback.format_exc())
            say(f"error: loading DeepSpeed's {', '.join(ops)}: {type(error).__name__}: {error}")
            sys.stderr.flush()
            os._exit(1)
        for load in loads:
            if load.action == "built":  # in the probe's time: the set-up step did not run
                say(load.line())

    def _calling_modules(self) -> list[Any]:
        """The modules whose forward is running, outermost first: each module call runs
        through ``Module._call_impl``, whose frame holds the module as ``self``."""
        code = self.torch.nn.Module._call_impl.__code__
        chain = []
        frame: Any = sys._getframe(1)
        while frame is not None:
            if frame.f_code is code:
                module = frame.f_locals.get("self")
                if module is not None:
                    chain.append(module)
            frame = frame.f_back
        chain.reverse()
        return chain

    def _count_checkpoints(self) -> None:
        """Count checkpointed blocks: ``torch.utils.checkpoint.checkpoint`` wrapped, and so
        is every module's name for it already imported (transformers, accelerate and torch's
        own checkpoint wrapper bind it at import; a warm process has imported them). A
        recompute in the backward does not call it again."""
        import torch.utils.checkpoint as checkpointing

        original = checkpointing.checkpoint

        @functools.wraps(original)
        def counted(function: Any, *args: Any, **kwargs: Any) -> Any:
            if self.stage is Stage.FORWARD and self.current is not None:
                self.current.checkpoints += 1
            return original(function, *args, **kwargs)

        checkpointing.checkpoint = counted
        _rebind(original, counted)

    def _watch_backward(self) -> None:
        """End a micro-step's forward where its backward begins: ``torch.autograd.backward``
        wrapped (``Tensor.backward``, and so accelerate's, DeepSpeed's and the Trainer's,
        call it), for a job whose model returns logits and whose loss is made outside any
        module (:meth:`_post_forward` sees no loss there). A reentrant checkpoint's own call
        in the backward finds the stage past the forward already."""
        import torch.autograd

        original = torch.autograd.backward

        @functools.wraps(original)
        def backward(*args: Any, **kwargs: Any) -> Any:
            if self.stage is Stage.FORWARD and self.current is not None:
                self.stage = Stage.BACKWARD
                loss = args[0] if args else kwargs.get("tensors")
                if isinstance(loss, self.torch.Tensor) and loss.numel() == 1:
                    self.current.losses.append(float(loss.detach().float().item()))
            return original(*args, **kwargs)

        torch.autograd.backward = backward
        _rebind(original, backward)

    def _watch_loss(self) -> None:
        """See the dtype the job's loss takes the logits in: ``F.cross_entropy`` and
        ``F.log_softmax`` wrapped (and every module's name for them already imported), each
        call over the vocabulary (the token embedding's rows, in the class dimension) in a
        training micro-step recorded. What counts is the dtype the op runs in: fp32 for fp32
        input or under autocast (both ops are on its fp32 list), else the logits' own. A
        fused kernel (Liger-Kernel's) or a compiled loss calls neither: nothing is recorded."""
        import torch.nn.functional as F

        torch = self.torch

        def seen(logits: Any, dim: int) -> None:
            if self.current is None or self.stage not in (Stage.FORWARD, Stage.BACKWARD):
                return
            if not isinstance(logits, torch.Tensor) or not logits.is_floating_point():
                return
            if not (logits.requires_grad and torch.is_grad_enabled()) or not self.vocab_rows:
                return
            if logits.dim() == 0 or logits.shape[dim] != self.vocab_rows:
                return
            wide = logits.dtype in (torch.float32, torch.float64)
            upcast = wide or torch.is_autocast_enabled(logits.device.type)
            self.loss_dtype = LossDtype.FP32 if upcast else LossDtype.LOGITS

        def watched(original: Any, class_dim: Any) -> Any:
            @functools.wraps(original)
            def call(input: Any, *args: Any, **kwargs: Any) -> Any:
                if not torch.compiler.is_compiling():
                    with contextlib.suppress(Exception):  # the job's call is never at risk
                        seen(input, class_dim(input, args, kwargs))
                return original(input, *args, **kwargs)

            return call

        def entropy_dim(input: Any, args: Any, kwargs: Any) -> int:
            return 1 if input.dim() >= 2 else 0

        def softmax_dim(input: Any, args: Any, kwargs: Any) -> int:
            dim = kwargs.get("dim", args[0] if args else None)
            return -1 if dim is None else int(dim)

        for name, class_dim in (("cross_entropy", entropy_dim), ("log_softmax", softmax_dim)):
            original = getattr(F, name)
            replacement = watched(original, class_dim)
            setattr(F, name, replacement)
            _rebind(original, replacement)

    def _checkpoint_problem(self, step: _Step) -> str | None:
        """Whether the job checkpointed the blocks autotune asked for, or what it did."""
        every, layers = self.spec.config.ac_every, self.model.num_layers
        seen = step.checkpoints / step.micro_steps
        if every == 0 and seen == 0:
            return None
        allowed = {len(range(0, layers, every)), layers // every} if every else {0}
        if seen in allowed:
            return None
        asked = f"ac:every-{every}" if every > 1 else "ac:every" if every else "none"
        how = (
            "does the script pass its TrainingArguments to the Trainer as given?"
            if self.job.framework is Framework.HF
            else f"does its {self.job.checkpointing_flag} turn checkpointing of every block on?"
            if self.job.checkpointing_flag
            else "does it turn checkpointing on from autotune.job_config().ac_every? (a script "
            "with a switch of its own for it: name it with --checkpointing-flag)"
        )
        return (
            f"the job checkpointed {seen:g} of {layers} decoder blocks per micro-step where "
            f"autotune asked for {asked} ({min(allowed)}): {how}"
        )

    def _sync(self) -> float:
        if self.device.type == "cuda":
            self.torch.cuda.synchronize(self.device)
        return _CLOCK()

    def _pre_forward(self, module: Any, args: Any) -> None:
        torch = self.torch
        if not (isinstance(module, torch.nn.Embedding) and module.training):
            return
        if not torch.is_grad_enabled() or not args or not isinstance(args[0], torch.Tensor):
            return
        ids = args[0]
        if ids.is_floating_point() or module.num_embeddings < self.vocab_rows:
            return
        if module.num_embeddings > self.vocab_rows:
            self.vocab_rows = module.num_embeddings  # a larger table: the token embedding
        self._last_ids = ids
        try:
            self._micro_step(tuple(ids.shape))
        finally:
            self._last_ids = None

    def _post_forward(self, module: Any, args: Any, output: Any) -> None:
        """A module returned a loss (a Hugging Face model's output, or a one-element tensor
        that needs gradients): the forward is done. (Module nesting is no guide: a
        checkpoint's recompute may stop inside a module.)"""
        if self.stage is not Stage.FORWARD or self.current is None:
            return
        loss = getattr(output, "loss", None)
        if loss is None and isinstance(output, dict):
            loss = output.get("loss")
        if loss is None and isinstance(output, self.torch.Tensor) and output.requires_grad:
            loss = output  # a loss module's output (nn.CrossEntropyLoss), or a model's own
        if isinstance(loss, self.torch.Tensor) and loss.numel() == 1:
            self.stage = Stage.BACKWARD
            self.current.losses.append(float(loss.detach().float().item()))

    def _micro_step(self, shape: tuple[int, ...]) -> None:
        """A training forward began: a micro-step, maybe the first of a new optimizer step."""
        if self.stage is Stage.FORWARD and self.current is not None:
            self.current.shapes[-1] = shape  # the same micro-step (another embedding call)
            return
        if self.stage is Stage.BUILD:
            self._set_data_aside()  # its scan of the process's objects in no step's time
        now = self._sync()
        if self.stage is Stage.BUILD:
            self.meter.reset()  # the model is built: the steps' peak starts here
            self.report.update(build_s=time.time() - self.began)
            self.current = _Step(began=now)
        elif self.stage is Stage.OPTIMIZER and self.current is not None:
            self.steps.append(self.current)
            if len(self.steps) >= self.spec.warmup_steps + self.spec.timed_steps:
                self.finish()
                sys.stdout.flush()
                sys.stderr.flush()
                end_descendants()
                os._exit(0)  # every rank is past this step's collectives: nothing waits on it
            self.current = _Step(began=self.current.ended)
        assert self.current is not None
        self.current.micro_steps += 1
        self.current.shapes.append(shape)
        self.current.wrappers.append(wrapper_of(self._calling_modules()))
        self.stage = Stage.FORWARD

    def _set_data_aside(self) -> None:
        """On the CPU, when training begins: take the job's in-memory data out of the
        emulated device's count, as a GPU run keeps it in host memory and copies each batch
        over. The rule: integer tensors whose storage is at least :data:`DATA_MIN_BYTES` and
        four times the first micro-batch's token ids, other than the model's buffers (token
        ids, labels and masks of a data set held as tensors; a model's weights and states are
        floating point). What was set aside is in the size's ``host_data_bytes``."""
        tracker = self.meter.tracker
        if tracker is None:
            return
        import gc

        torch = self.torch
        modules = self._calling_modules()
        ids = self._last_ids
        batch = ids.numel() * ids.element_size() if ids is not None else 0
        buffers = {
            b.untyped_storage()._cdata for m in modules[:1] for b in m.buffers() if not b.is_meta
        }
        aside = 0
        with warnings.catch_warnings():  # isinstance on a deprecated proxy warns
            warnings.simplefilter("ignore")
            objects = gc.get_objects()
            tensors = [obj for obj in objects if isinstance(obj, torch.Tensor)]
        del objects
        for obj in tensors:
            if obj.is_floating_point() or obj.is_complex():
                continue
            if obj.device.type != "cpu" or obj.is_meta:
                continue
            try:
                storage = obj.untyped_storage()
            except (RuntimeError, NotImplementedError):
                continue
            nbytes = storage.nbytes()
            if nbytes < max(DATA_MIN_BYTES, 4 * batch) or storage._cdata in buffers:
                continue
            if tracker.counts(storage):
                aside += tracker.set_aside(storage)
        if aside:
            self.host_data_bytes += aside

    def _pre_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if self.current is None:
            return
        self.optimizers.add(type(optimizer).__name__)
        if self.joined is None:
            dist = self.torch.distributed
            grouped = dist.is_available() and dist.is_initialized()
            self.joined = dist.get_world_size() if grouped else 1
        if self.stage is not Stage.OPTIMIZER:
            self.current.optimizer_began = self._sync()
        self.stage = Stage.OPTIMIZER

    def _post_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if self.current is not None:
            self.current.ended = self._sync()

    # ---- the report -------------------------------------------------------------------------

    def _engine_problem(self) -> tuple[Wrapper, str] | None:
        """The engine that trained where it is not the one the probe asked for, and the line
        that says so; None where every micro-step trained under the engine asked."""
        config = self.spec.config
        for step in self.steps:
            for seen in step.wrappers:
                if not seen.matches(config, self.world_size):
                    return seen, (
                        f"the job trained under {seen.name} where autotune asked for "
                        f"{_asked_engine(config, self.world_size)}: "
                        f"{_engine_hint(self.job, config.engine)}"
                    )
        return None

    def _mismatch(self) -> str | None:
        """What the script fed that the probe did not ask for, or None."""
        if self.world_size > 1 and self.joined != self.world_size:
            return (
                f"the job's {self.world_size} ranks did not train as one process group "
                "(each trained alone): does the script, or its framework on this device, "
                "join the process group torchrun's variables describe?"
            )
        for step in self.steps:
            problem = self._checkpoint_problem(step)
            if problem is not None:
                return problem
            if step.micro_steps != self.spec.grad_accum:
                return (
                    f"the script ran {step.micro_steps} micro-steps per optimizer step where "
                    f"autotune asked for {self.spec.grad_accum}: {_batch_hint(self.job)}"
                )
            problem = self._shape_problem(step.shapes)
            if problem is not None:
                return problem
        return None

    def _shape_problem(self, shapes: list[tuple[int, ...]]) -> str | None:
        """The first micro-batch of ``shapes`` (token ids fed) that is not the batch and
        sequence length asked, said in one line; None if every one is."""
        want_batch, want_seq = self.spec.micro_batch_sizes[0], self.spec.seq_len
        for shape in shapes:
            if len(shape) < 2:
                continue
            if shape[0] != want_batch:
                return (
                    f"the script fed micro-batches of {shape[0]} sequences where autotune "
                    f"asked for {want_batch}: {_batch_hint(self.job)}"
                )
            if shape[-1] != want_seq:
                return (
                    f"the script fed sequences of {shape[-1]} tokens where --seq-len is "
                    f"{want_seq}: give --seq-len {shape[-1]}, or pack or pad its data to "
                    f"{want_seq}"
                )
        return None

    def finish(self) -> None:
        """The warm-up and timed steps are done: write the measured size."""
        from autotune.hardware import peak_flops_for
        from autotune.probe.metrics import probe_throughput

        self.done = True
        spec, mbs = self.spec, self.spec.micro_batch_sizes[0]
        memory = self.meter.read()
        engine = self._engine_problem() if self.joined in (None, self.world_size) else None
        if engine is not None:
            seen, said = engine
            # What trained is kept: the search learns the engines the job trains under.
            memory = {
                **memory,
                "trained_engine": seen.engine.value,
                "trained_zero_stage": seen.zero_stage,
                "wrapper": seen.name,
            }
            self._fail_size(
                Outcome.ERROR, Stage.FORWARD, said, "EngineMismatch", memory, mistake=True
            )
            return
        problem = self._mismatch()
        if problem is not None:
            self._fail_size(
                Outcome.ERROR, Stage.FORWARD, problem, "BatchMismatch", memory, mistake=True
            )
            return
        timed = self.steps[spec.warmup_steps :]
        micro = [(s.optimizer_began - s.began) / s.micro_steps for s in timed]
        optimizer = [s.ended - s.optimizer_began for s in timed]
        peak_flops = gpu_name = None
        if self.device.type == "cuda":
            gpu_name = self.torch.cuda.get_device_name(self.device)
            peak_flops = peak_flops_for(gpu_name, spec.config.precision.compute_dtype)
        speed = probe_throughput(
            spec,
            self.model,
            mbs,
            micro_step_s=statistics.median(micro),
            optimizer_step_s=statistics.median(optimizer),
            peak_flops=peak_flops,
        )
        losses = [loss for step in self.steps for loss in step.losses[-1:]]
        first = self.steps[0].began
        window = self.steps[spec.warmup_steps - 1].ended if spec.warmup_steps else first
        finite = all(map(_finite, losses))
        entry: dict[str, Any] = {
            "micro_batch_size": mbs,
            "outcome": Outcome.OK.value if finite else Outcome.ERROR.value,
            "losses": losses,
            "loss_finite": finite,
            "warmup_s": window - first,
            "timed_s": self.steps[-1].ended - window,
            "step_times": [step.ended - step.began for step in timed],
            "tokens_counted": bool(self.vocab_rows),
            "optimizers": sorted(self.optimizers),
            "wrapper": self.steps[-1].wrappers[-1].name,
            "trained_engine": self.steps[-1].wrappers[-1].engine.value,
            "trained_zero_stage": self.steps[-1].wrappers[-1].zero_stage,
            "checkpointed_blocks": self.steps[-1].checkpoints / self.steps[-1].micro_steps,
            "host_data_bytes": self.host_data_bytes,
            "loss_dtype": None if self.loss_dtype is None else self.loss_dtype.value,
            **speed.to_dict(),
            **memory,
        }
        if not finite:
            entry["message"] = "loss is not finite"
        self.report.data["sizes"].append(entry)
        self.report.update(
            gpu_name=gpu_name, peak_flops=peak_flops, num_params=self.model.num_params
        )
        self.report.finish()
        if self.rank == 0:
            print(
                f"autotune: micro-batch {mbs}: {speed.tokens_per_second:.1f} tokens/s over "
                f"{len(timed)} timed steps of the job",
                flush=True,
            )

    def _fail_size(
        self,
        outcome: Outcome,
        stage: Stage,
        message: str,
        kind: str,
        memory: dict[str, Any],
        *,
        mistake: bool = False,
    ) -> None:
        """Write the size as failed; ``mistake``: the job did not do what autotune asked (an
        ignored flag, another engine, an end before its first step), which says nothing of
        the configuration (:attr:`~autotune.probe.result.ProbeResult.job_mistake`)."""
        self.report.data["sizes"].append(
            {
                "micro_batch_size": self.spec.micro_batch_sizes[0],
                "outcome": outcome.value,
                "stage": stage.value,
                "message": message,
                **memory,
                **({JOB_MISTAKE: True} if mistake else {}),
            }
        )
        self.report.fail(outcome, stage, message, kind)

    def failed(self, error: BaseException, trace: str) -> None:
        """An exception the script did not catch."""
        if self.done:
            return
        self.done = True
        self.report.data["traceback"] = trace[-8000:]
        fed = [*(s for step in self.steps for s in step.shapes)]
        fed += self.current.shapes if self.current is not None else []
        problem = self._shape_problem(fed)
        if problem is not None:
            # Out of memory (or failing) on a batch autotune did not ask for says nothing of
            # the configuration: the job's mistake is what there is to say.
            self._fail_size(
                Outcome.ERROR, self.stage, problem, "BatchMismatch", self.meter.read(), mistake=True
            )
            return
        oom = is_oom_error(error)
        message = f"{type(error).__name__}: {error}".splitlines()[0][:500]
        self._fail_size(
            Outcome.OOM if oom else Outcome.ERROR,
            self.stage,
            message,
            type(error).__name__,
            self.meter.read(),
        )

    def ended(self) -> None:
        """The script ended: say how, if the layer has not yet, and end what the job started
        that still runs (a child in a session of its own, a daemon re-parented here)."""
        try:
            self._ended()
        finally:
            end_descendants()

    def _ended(self) -> None:
        """The script ended (or exited) before the probe's steps were done."""
        if self.done:
            return
        if self.stage is Stage.OPTIMIZER and self.current is not None:
            self.steps.append(self.current)
            self.current = None
        need = self.spec.warmup_steps + self.spec.timed_steps
        if len(self.steps) >= need:
            self.finish()
            return
        self.done = True
        if self.stage is Stage.BUILD:
            message = (
                "the script ended before its first training step: does it train with the "
                "arguments given after --?"
            )
        else:
            message = (
                f"the script ended after {len(self.steps)} optimizer steps; a probe needs "
                f"{need}: give it data and steps for at least {need + 1}"
            )
        self._fail_size(
            Outcome.ERROR, self.stage, message, "EndedEarly", self.meter.read(), mistake=True
        )


def _rebind(original: Any, replacement: Any) -> None:
    """Point every loaded module's name for ``original`` at ``replacement`` (names bound by
    ``from ... import`` before the layer was installed: a warm process has imported them)."""
    for module in list(sys.modules.values()):
        names = getattr(module, "__dict__", None)
        if not isinstance(names, dict):
            continue
        for name, value in list(names.items()):
            if value is original:
                setattr(module, name, replacement)


def _finite(value: float) -> bool:
    return value == value and value not in (float("inf"), float("-inf"))


_layer: Layer | None = None


def run_warm(probe_dir: Path, argv: list[str]) -> int:
    """Run the job's script in this process, a fork of the warm worker process (which
    imported torch and transformers once), with the layer on; its exit code. What Python does
    for ``python script.py ARGS``: the script's folder first on ``sys.path``, the script as
    ``__main__``."""
    global _layer
    spec = ProbeSpec.from_dict(json.loads((probe_dir / "config.json").read_text()))
    _layer = Layer(probe_dir, spec)
    _layer.install()
    script = argv[0]
    sys.argv = list(argv)
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    code = 0
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as done:
        if isinstance(done.code, int) or done.code is None:
            code = done.code or 0
        else:
            print(done.code, file=sys.stderr)
            code = 1
    except BaseException as error:
        _layer.failed(error, traceback.format_exc())
        traceback.print_exc()
        code = 1
    _layer.ended()
    return code


def install() -> Layer | None:
    """Turn the layer on if this process runs the job's script (``sitecustomize`` calls it)."""
    global _layer
    where = os.environ.get(PROBE_DIR_ENV)
    if not where or _layer is not None:
        return _layer
    probe_dir = Path(where)
    spec = ProbeSpec.from_dict(json.loads((probe_dir / "config.json").read_text()))
    from autotune.probe.lifetime import PARENT_ENV, die_with_parent

    parent = os.environ.get(PARENT_ENV)
    # The tuner's own child (a rank, or the framework's launcher: accelerate launch) dies with
    # the tuner; a rank the framework's launcher started dies with that launcher.
    direct = parent is not None and parent.isdigit() and os.getppid() == int(parent)
    if spec.script is None or not runs_script(spec.script, list(sys.orig_argv)):
        if direct and parent is not None:
            die_with_parent(int(parent))
        return None
    die_with_parent(int(parent) if direct and parent is not None else None)
    _layer = Layer(probe_dir, spec)
    _layer.install()
    return _layer
