"""Calls of an implementation under test that never return, or fault the GPU.

A kernel that spins forever (a program waiting on a flag no program sets, a loop whose bound
never comes) holds the main thread inside a CUDA synchronization or the interpreter's loop, where
no exception can reach it and Ctrl-C may not either: a timer thread says what hung and ends the
process itself. A kernel that faults (an illegal address) is reported by whatever next touches
the GPU, so the call is followed by a wait for its launches, which charges the fault to it.
"""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

from ops import backend


class Watchdog:
    """``with watchdog.watching(subject):`` around one call. Past ``seconds`` (None: no limit)
    ``report(subject, seconds)`` runs on the timer thread, then the process exits with 1 (the
    implementation under test failed): the main thread, stuck in the hung call, never resumes."""

    def __init__(self, seconds: float | None, report: Callable[[Any, float], None]) -> None:
        self.seconds = seconds
        self.report = report

    @contextmanager
    def watching(self, subject: Any) -> Iterator[None]:
        if not self.seconds:
            yield
            return
        timer = threading.Timer(self.seconds, self._expire, args=(subject,))
        timer.daemon = True
        timer.start()
        try:
            yield
        finally:
            timer.cancel()
            timer.join()  # gone before the caller goes on: a timer thread alive at exit can abort it

    def _expire(self, subject: Any) -> None:
        try:
            self.report(subject, self.seconds)
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(1)


NO_LIMIT = Watchdog(None, lambda subject, seconds: None)
HANG = "it hangs (a program waiting for something that never comes, a loop that never ends) or is that slow"


def wait_for_device() -> None:
    """On the GPU, wait for the launches made so far, so that a fault they cause is raised here
    (not while a graph is being captured, where waiting is not allowed)."""
    if backend.name() == "cuda" and not torch.cuda.is_current_stream_capturing():
        torch.cuda.synchronize()


def device_lost() -> bool:
    """After a call raised: whether the GPU went with it. A CUDA fault is sticky (every later call
    in the process fails), so nothing else can run on the device."""
    if backend.name() != "cuda":
        return False
    try:
        torch.cuda.synchronize()
    except Exception:  # torch.AcceleratorError (a RuntimeError) repeating the fault
        return True
    return False
