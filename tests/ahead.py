"""Commands started ahead of the tests that read them, two at a time.

A test module whose tests each wait for a fresh interpreter (the CLI's checks and help
texts) spends most of its time in those interpreters' imports, on one core of the suite's
two. Such a module names its runner ``AHEAD = Ahead(run)`` and calls it as it would call
``run``; a test marked ``@pytest.mark.ahead(args, ..., **kwargs)`` declares the calls it
makes. When the module starts, ``tests/conftest.py`` queues the declared calls of its
selected tests, in test order, and two run at a time in the background. A test gets the
result of its own launch: the same subprocess with the same arguments, only started
earlier. A call declared twice is launched twice (a test comparing two runs gets two
processes); a call nobody declared, or one still waiting its turn, runs when it is made.
"""

from __future__ import annotations

import subprocess
from collections import defaultdict, deque
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, Hashable, Optional

WORKERS = 2


def _key(args: tuple, kwargs: dict) -> Hashable:
    return tuple(args), tuple(sorted(kwargs.items()))


class Ahead:
    """Runs ``run(*args, **kwargs)`` calls (each one subprocess) ahead of their use."""

    def __init__(self, run: Callable[..., subprocess.CompletedProcess]):
        self._run = run
        self._executor: Optional[ThreadPoolExecutor] = None
        self._queued: dict[Hashable, deque[Future]] = defaultdict(deque)

    def start(self, *calls: tuple, **kwargs: Any) -> None:
        """Queue one launch per ``args`` tuple in ``calls``, each with ``kwargs``."""
        if self._executor is None:
            self._executor = ThreadPoolExecutor(WORKERS, thread_name_prefix="ahead")
        for args in calls:
            self._queued[_key(args, kwargs)].append(
                self._executor.submit(self._run, *args, **kwargs))

    def __call__(self, *args: Any, **kwargs: Any) -> subprocess.CompletedProcess:
        queued = self._queued.get(_key(args, kwargs))
        if queued:
            launch = queued.popleft()
            if not launch.cancel():  # running or done: its result; else it runs now, here
                return launch.result()
        return self._run(*args, **kwargs)

    def stop(self) -> None:
        """Drop the launches no test asked for; wait for those already running."""
        if self._executor is not None:
            self._executor.shutdown(wait=True, cancel_futures=True)
        self._executor = None
        self._queued.clear()
