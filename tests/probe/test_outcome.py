"""Tests for autotune.probe.outcome: OOM detection and the classification of a whole probe."""

from __future__ import annotations

import signal
from typing import Any

import pytest
import torch

from autotune.probe.outcome import (
    Outcome,
    RankExit,
    Stage,
    classify_probe,
    is_oom_error,
    is_oom_message,
    is_peer_failure,
)

# A real message of gloo when the other rank of a collective died.
GLOO_PEER = (
    "RuntimeError: [../third_party/gloo/gloo/transport/tcp/pair.cc:534] "
    "Connection closed by peer [127.0.0.1]:40211"
)


# --- is_oom_error / is_oom_message -------------------------------------------------------------


def test_real_cpu_allocator_failure_is_an_oom() -> None:
    """The RuntimeError the CPU allocator really raises for an impossible size is an OOM."""
    with pytest.raises(RuntimeError) as caught:
        torch.empty(2**60, dtype=torch.uint8)
    assert not isinstance(caught.value, torch.OutOfMemoryError)  # only the message tells
    assert is_oom_error(caught.value)


@pytest.mark.parametrize(
    "error",
    [
        torch.OutOfMemoryError("anything at all"),
        torch.OutOfMemoryError(),
        MemoryError(),
    ],
    ids=["torch-oom", "torch-oom-no-message", "python-memory-error"],
)
def test_oom_by_type(error: BaseException) -> None:
    """OOM exception types are OOMs whatever their message says."""
    assert is_oom_error(error)


@pytest.mark.parametrize(
    "message",
    [
        "[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate "
        "memory: you tried to allocate 1152921504606846976 bytes. Error code 12",
        "CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`",
        "CUDA out of memory. Tried to allocate 2.00 GiB (GPU 0; 79.15 GiB total capacity)",
        "cuDNN error: CUDNN_STATUS_NOT_ENOUGH_WORKSPACE",
        "cuDNN error: CUDNN_STATUS_ALLOC_FAILED",
        "HIP out of memory. Tried to allocate 20.00 MiB",
        "XPU out of memory. Tried to allocate 1.00 GiB",
        "CUDA error: out of memory\nCUDA kernel errors might be asynchronously reported",
        "cudaErrorMemoryAllocation: out of memory",
        "NCCL error in: ProcessGroupNCCL.cpp:1970, unhandled system error, NCCL version 2.21.5\n"
        "ncclSystemError: System call (e.g. socket, malloc) or external library call failed "
        "or device error.",
    ],
    ids=[
        "cpu-allocator",
        "cublas",
        "cuda",
        "cudnn-workspace",
        "cudnn-alloc",
        "hip",
        "xpu",
        "cuda-error-oom",
        "cuda-runtime-enum",
        "nccl-system",
    ],
)
def test_oom_by_message_fallback(message: str) -> None:
    """Plain RuntimeErrors (and bare texts) with an allocator-failure message are OOMs."""
    assert is_oom_message(message)
    assert is_oom_message(message.upper())  # case does not matter
    assert is_oom_error(RuntimeError(message))


def test_oom_message_in_an_accelerator_error() -> None:
    """torch.AcceleratorError (CUDA errors since torch 2.8) is a RuntimeError: text decides."""
    assert is_oom_error(torch.AcceleratorError("CUDA error: out of memory"))
    assert not is_oom_error(torch.AcceleratorError("CUDA error: an illegal memory access"))


@pytest.mark.parametrize(
    "error",
    [
        RuntimeError("Expected all tensors to be on the same device, but found cuda:0 and cpu"),
        RuntimeError("mat1 and mat2 shapes cannot be multiplied (4x64 and 32x64)"),
        RuntimeError("the layout of memory is not contiguous"),  # "out of memory" w/o a space
        RuntimeError(),
        ValueError("bad value"),
        KeyError("out of memory"),  # not a RuntimeError: its text is not consulted
        RuntimeError(GLOO_PEER),
        RuntimeError("CUDA error: an illegal memory access was encountered"),
    ],
    ids=[
        "device-mismatch",
        "shape",
        "layout-of-memory",
        "no-args",
        "value-error",
        "key-error",
        "peer-failure",
        "illegal-access",
    ],
)
def test_not_oom(error: BaseException) -> None:
    """Other failures are not OOMs."""
    assert not is_oom_error(error)


def test_not_oom_message() -> None:
    """Texts without an allocator failure are not OOMs."""
    assert not is_oom_message("")
    assert not is_oom_message("loss is not finite")
    assert not is_oom_message("Segmentation fault (core dumped)")


@pytest.mark.parametrize(
    "message",
    [
        GLOO_PEER,
        "Connection reset by peer",
        "[Errno 32] Broken pipe",
        "NCCL communicator was aborted on rank 1",
        "Socket Timeout",
        "RuntimeError: Timed out in call to Gloo all-reduce after 60000ms",
    ],
)
def test_peer_failure_messages(message: str) -> None:
    """Errors that only say another rank went away are recognised as peer failures."""
    assert is_peer_failure(message)


def test_root_causes_are_not_peer_failures() -> None:
    """A rank's own error is not a peer failure."""
    assert not is_peer_failure("RuntimeError: injected failure (AUTOTUNE_TEST_FAULT)")
    assert not is_peer_failure("OutOfMemoryError: emulated device out of memory")
    assert not is_peer_failure("")


# --- classify_probe ----------------------------------------------------------------------------


def _report(status: str = "ok", stage: str | None = None, message: str = "") -> dict[str, Any]:
    return {"status": status, "stage": stage, "message": message, "sizes": []}


def _ok(rank: int) -> RankExit:
    return RankExit(rank=rank, returncode=0, report=_report())


def test_all_ranks_ok() -> None:
    """Every rank exited 0 with an ok report: the probe is ok."""
    verdict = classify_probe([_ok(0), _ok(1)], timed_out=False)
    assert verdict.outcome is Outcome.OK
    assert verdict.rank is None
    assert verdict.stage is None


def test_clean_exit_without_a_report_is_an_error() -> None:
    """A rank that exited 0 without a report that can be read makes the probe an error that
    names the rank and what is wrong, never ok from the other ranks' reports."""
    exits = [_ok(0), RankExit(rank=1, returncode=0, report_problem="rank1.json is empty")]
    verdict = classify_probe(exits, timed_out=False)
    assert verdict.outcome is Outcome.ERROR
    assert verdict.rank == 1
    assert "rank 1" in verdict.message and "rank1.json is empty" in verdict.message
    alone = classify_probe([RankExit(rank=0, returncode=0)], timed_out=False)
    assert (alone.outcome, alone.rank) == (Outcome.ERROR, 0)
    assert "left no report" in alone.message


def test_oom_in_any_rank_wins() -> None:
    """An OOM in rank 1 is the probe's outcome even though rank 0 saw a peer error first."""
    exits = [
        RankExit(rank=0, returncode=1, report=_report("error", "backward", GLOO_PEER)),
        RankExit(
            rank=1,
            returncode=1,
            report=_report("oom", "forward", "OutOfMemoryError: CUDA out of memory."),
        ),
    ]
    verdict = classify_probe(exits, timed_out=False)
    assert verdict.outcome is Outcome.OOM
    assert verdict.stage is Stage.FORWARD
    assert verdict.rank == 1
    assert "CUDA out of memory" in verdict.message


def test_oom_wins_over_host_oom_timeout_and_crash() -> None:
    """A reported OOM outranks an unexpected SIGKILL, a segfault and the timeout."""
    exits = [
        RankExit(rank=0, returncode=-signal.SIGKILL),
        RankExit(rank=1, returncode=-signal.SIGSEGV),
        RankExit(rank=2, returncode=1, report=_report("oom", "backward", "out of memory")),
    ]
    verdict = classify_probe(exits, timed_out=True)
    assert verdict.outcome is Outcome.OOM
    assert verdict.stage is Stage.BACKWARD
    assert verdict.rank == 2


def test_oom_report_without_stage() -> None:
    """An OOM report with no stage gives no stage (not an error)."""
    exits = [RankExit(rank=0, returncode=1, report=_report("oom", None, "out of memory"))]
    verdict = classify_probe(exits, timed_out=False)
    assert verdict.outcome is Outcome.OOM
    assert verdict.stage is None


def test_single_process_recovered_oom_is_still_oom() -> None:
    """A rank that recovered from an OOM exits 0 but reports oom: the probe is oom."""
    exits = [RankExit(rank=0, returncode=0, report=_report("oom", "forward", "out of memory"))]
    assert classify_probe(exits, timed_out=False).outcome is Outcome.OOM


def test_unexpected_sigkill_is_host_oom() -> None:
    """A SIGKILL the launcher did not send means the kernel's OOM killer."""
    exits = [
        RankExit(rank=0, returncode=-signal.SIGKILL),
        RankExit(rank=1, returncode=1, report=_report("error", "forward", GLOO_PEER)),
    ]
    verdict = classify_probe(exits, timed_out=False)
    assert verdict.outcome is Outcome.HOST_OOM
    assert verdict.rank == 0
    assert "SIGKILL" in verdict.message


def test_host_oom_wins_over_timeout() -> None:
    """An unexpected SIGKILL is reported even when the probe also ran out of time."""
    exits = [
        RankExit(rank=0, returncode=-signal.SIGKILL, killed_by_launcher=True),
        RankExit(rank=1, returncode=-signal.SIGKILL),
    ]
    verdict = classify_probe(exits, timed_out=True)
    assert verdict.outcome is Outcome.HOST_OOM
    assert verdict.rank == 1


def test_launcher_sigkill_is_not_host_oom() -> None:
    """A SIGKILL the launcher sent at the timeout is a timeout."""
    exits = [
        RankExit(rank=0, returncode=-signal.SIGTERM, killed_by_launcher=True),
        RankExit(rank=1, returncode=-signal.SIGKILL, killed_by_launcher=True),
    ]
    verdict = classify_probe(exits, timed_out=True)
    assert verdict.outcome is Outcome.TIMEOUT
    assert verdict.rank is None


def test_timeout_wins_over_crash_and_error() -> None:
    """Timed out: that is the outcome even if a rank crashed or reported an error."""
    exits = [
        RankExit(rank=0, returncode=1, report=_report("error", "forward", "ValueError: x")),
        RankExit(rank=1, returncode=-signal.SIGSEGV),
    ]
    assert classify_probe(exits, timed_out=True).outcome is Outcome.TIMEOUT


@pytest.mark.parametrize(
    ("sig", "name"),
    [(signal.SIGSEGV, "SIGSEGV"), (signal.SIGABRT, "SIGABRT"), (signal.SIGBUS, "SIGBUS")],
)
def test_other_signals_are_crashes(sig: signal.Signals, name: str) -> None:
    """A rank that died from another signal crashed; the message names the signal."""
    exits = [
        RankExit(rank=0, returncode=1, report=_report("error", "backward", GLOO_PEER)),
        RankExit(rank=1, returncode=-sig),
    ]
    verdict = classify_probe(exits, timed_out=False)
    assert verdict.outcome is Outcome.CRASH
    assert verdict.rank == 1
    assert name in verdict.message


def test_unknown_signal_number() -> None:
    """A signal number with no name is still a crash, named by number."""
    verdict = classify_probe([RankExit(rank=0, returncode=-200)], timed_out=False)
    assert verdict.outcome is Outcome.CRASH
    assert "200" in verdict.message


def test_crash_wins_over_reported_error() -> None:
    """A segfaulting rank is the cause; another rank's own error report ranks below it."""
    exits = [
        RankExit(rank=0, returncode=1, report=_report("error", "forward", "ValueError: x")),
        RankExit(rank=1, returncode=-signal.SIGSEGV),
    ]
    assert classify_probe(exits, timed_out=False).outcome is Outcome.CRASH


def test_signals_sent_by_the_launcher_are_not_crashes() -> None:
    """After one rank's error the launcher SIGTERMs the rest: the error is the outcome."""
    exits = [
        RankExit(
            rank=0,
            returncode=1,
            report=_report("error", "forward", "RuntimeError: injected failure"),
        ),
        RankExit(rank=1, returncode=-signal.SIGTERM, killed_by_launcher=True),
    ]
    verdict = classify_probe(exits, timed_out=False)
    assert verdict.outcome is Outcome.ERROR
    assert verdict.stage is Stage.FORWARD
    assert verdict.rank == 0
    assert verdict.message == "RuntimeError: injected failure"


def test_reported_error_in_build() -> None:
    """An error report carries its stage through."""
    exits = [RankExit(rank=0, returncode=1, report=_report("error", "build", "ValueError: b"))]
    verdict = classify_probe(exits, timed_out=False)
    assert verdict.outcome is Outcome.ERROR
    assert verdict.stage is Stage.BUILD


def test_peer_failure_ranked_below_root_cause() -> None:
    """Rank 0 only lost its peer; rank 1's own error is the cause, whatever the rank order."""
    exits = [
        RankExit(rank=0, returncode=1, report=_report("error", "backward", GLOO_PEER)),
        RankExit(rank=1, returncode=1, report=_report("error", "forward", "ValueError: root")),
    ]
    verdict = classify_probe(exits, timed_out=False)
    assert verdict.outcome is Outcome.ERROR
    assert verdict.rank == 1
    assert verdict.message == "ValueError: root"
    assert verdict.stage is Stage.FORWARD


def test_peer_failure_with_a_silent_death_blames_the_dead_rank() -> None:
    """A peer-failure report plus a rank that exited non-zero without a report: blame the latter."""
    exits = [
        RankExit(rank=0, returncode=1, report=_report("error", "backward", GLOO_PEER)),
        RankExit(rank=1, returncode=3, stderr_tail="Traceback ...\nSystemExit: boom\n"),
    ]
    verdict = classify_probe(exits, timed_out=False)
    assert verdict.outcome is Outcome.ERROR
    assert verdict.rank == 1
    assert "code 3" in verdict.message
    assert "SystemExit: boom" in verdict.message


def test_only_peer_failures_are_still_errors() -> None:
    """If every report is a peer failure and nobody else died, the report is the outcome."""
    exits = [RankExit(rank=0, returncode=1, report=_report("error", "backward", GLOO_PEER))]
    verdict = classify_probe(exits, timed_out=False)
    assert verdict.outcome is Outcome.ERROR
    assert verdict.rank == 0


def test_nonzero_exit_without_report() -> None:
    """A rank that exited 1 before writing anything is an error, with its last stderr line."""
    exits = [
        _ok(0),
        RankExit(
            rank=1,
            returncode=1,
            stderr_tail="Traceback (most recent call last):\nImportError: no module x\n",
        ),
    ]
    verdict = classify_probe(exits, timed_out=False)
    assert verdict.outcome is Outcome.ERROR
    assert verdict.rank == 1
    assert verdict.message == "rank 1 exited with code 1: ImportError: no module x"


def test_nonzero_exit_without_report_but_oom_in_stderr() -> None:
    """Without a report, an OOM text in stderr still makes the probe an OOM."""
    exits = [
        RankExit(
            rank=0,
            returncode=1,
            stderr_tail="torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2 GiB\n",
        )
    ]
    assert classify_probe(exits, timed_out=False).outcome is Outcome.OOM


def test_nonzero_exit_with_ok_report() -> None:
    """An ok report does not hide a non-zero exit code."""
    exits = [RankExit(rank=0, returncode=1, report=_report())]
    verdict = classify_probe(exits, timed_out=False)
    assert verdict.outcome is Outcome.ERROR
    assert "code 1" in verdict.message


def test_unreaped_rank_is_not_ok() -> None:
    """A rank whose exit status is unknown (not reaped) does not pass as ok."""
    exits = [_ok(0), RankExit(rank=1, returncode=None)]
    verdict = classify_probe(exits, timed_out=False)
    assert verdict.outcome is Outcome.ERROR
    assert verdict.rank == 1
