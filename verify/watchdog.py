"""A time limit on each case, for an implementation that never returns.

A kernel that spins forever (a program waiting on a flag no program sets, a loop whose bound
never comes) holds the main thread inside a CUDA synchronization or the interpreter's loop, where
no exception can reach it and Ctrl-C may not either. So a timer thread says which case hung and
ends the process itself.
"""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from verify.cases import Case


class CaseTimer:
    """``with timer.running(case):`` around one case's work. Past ``seconds`` (None: no limit)
    ``report(case, seconds)`` is called from the timer thread, then the process exits with
    ``status``: the main thread, stuck in the hung call, never resumes."""

    def __init__(self, seconds: float | None, report: Callable[[Case, float], None], status: int = 1) -> None:
        self.seconds = seconds
        self.report = report
        self.status = status

    @contextmanager
    def running(self, case: Case) -> Iterator[None]:
        if not self.seconds:
            yield
            return
        timer = threading.Timer(self.seconds, self._expire, args=(case,))
        timer.daemon = True
        timer.start()
        try:
            yield
        finally:
            timer.cancel()

    def _expire(self, case: Case) -> None:
        try:
            self.report(case, self.seconds)
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(self.status)


NO_LIMIT = CaseTimer(None, lambda case, seconds: None)
