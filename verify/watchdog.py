"""Calls of an implementation under test that never return, or fault the GPU.

A kernel that spins forever (a program waiting on a flag no program sets, a loop whose bound
never comes) holds the main thread inside a CUDA synchronization or the interpreter's loop, where
no exception can reach it and Ctrl-C may not either: a timer thread says what hung and ends the
process itself. A kernel that faults (an illegal address) is reported by whatever next touches
the GPU, so the call is followed by a wait for its launches, which charges the fault to it.
"""

from __future__ import annotations

import faulthandler
import os
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, NoReturn

import torch

from ops import backend
from verify.cli import end_process

BACKSTOP_S = 10.0  # past the timeout, faulthandler ends a hang that holds the GIL (the timer cannot run)


class ProcessExitCalled(Exception):
    """An implementation under test called ``os._exit``: reported as what it raised, not obeyed
    (``os._exit(0)`` would end the run with 0, read as verified)."""


@contextmanager
def process_exit_refused() -> Iterator[None]:
    """``os._exit`` raises :class:`ProcessExitCalled` while an implementation is imported or runs."""

    def refuse(status: int) -> NoReturn:
        raise ProcessExitCalled(f"it called os._exit({status})")

    os._exit = refuse
    try:
        yield
    finally:
        os._exit = end_process


def _stream_with_a_file() -> Any:
    """stderr, or the process's own where it is captured (pytest): faulthandler writes to a file
    descriptor; None where there is none."""
    for stream in (sys.stderr, sys.__stderr__):
        try:
            stream.fileno()
            return stream
        except (AttributeError, OSError, ValueError):  # io.UnsupportedOperation is both
            continue
    return None


class Watchdog:
    """``with watchdog.watching(subject):`` around one call. Past ``seconds`` (None: no limit)
    ``report(subject, seconds)`` runs on the timer thread, then the process exits with ``status``
    (1: the implementation under test failed): the main thread, stuck in the hung call, never
    resumes."""

    def __init__(self, seconds: float | None, report: Callable[[Any, float], None], status: int = 1) -> None:
        self.seconds = seconds
        self.report = report
        self.status = status

    @contextmanager
    def watching(self, subject: Any) -> Iterator[None]:
        if not self.seconds:
            with process_exit_refused():
                yield
            return
        timer = threading.Timer(self.seconds, self._expire, args=(subject,))
        timer.daemon = True
        timer.start()
        # a call holding the GIL (a C loop) starves the timer: faulthandler's C thread then dumps
        # every thread's stack and exits with 1 (the implementation under test failed)
        stream = _stream_with_a_file()
        if stream is not None:
            backstop = min(self.seconds + BACKSTOP_S, threading.TIMEOUT_MAX)  # past it: OverflowError
            faulthandler.dump_traceback_later(backstop, exit=True, file=stream)
        try:
            with process_exit_refused():
                yield
        finally:
            faulthandler.cancel_dump_traceback_later()
            timer.cancel()
            timer.join()  # gone before the caller goes on: a timer thread alive at exit can abort it

    def _expire(self, subject: Any) -> None:
        try:
            self.report(subject, self.seconds)
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            end_process(self.status)


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
