"""The model's one worker: requests queue behind the model, one generation at a time, the queue bounded.

`ModelWorker.submit(job)` runs `job()` on the worker's single thread, in arrival order, and returns its `Future`. At
most one job runs and `max_queue` wait; one more is refused at once with `QueueFull` (the server's 429) carrying a
`retry_after` estimate (the jobs ahead times the recent mean job time). A request that has work to do before its job
exists (fetching and decoding its images) first takes its place with `reserve()`, so a full queue refuses it before
that work, and then `Place.submit(job)`s or `Place.release()`s it. A job that is cancelled (its client went
away) ends at its next token through the cancel flag the server hands `respond`, so the next one starts. The counts
(`running`, `waiting`, `answered`, `cancelled`, `failed`) are what `GET /health` reports.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any


class Cancelled(Exception):
    """A job whose client went away: a queued request whose client left before it started, or the page's evidence
    cancelled from the page. The worker counts it as "cancelled"."""


class QueueFull(RuntimeError):
    """The worker already has one job running and `max_queue` waiting."""

    def __init__(self, waiting: int, retry_after: int) -> None:
        super().__init__(f"the model is busy: {waiting} request(s) already wait for it; retry in {retry_after} s")
        self.retry_after = retry_after


class ModelWorker:
    def __init__(self, max_queue: int) -> None:
        if max_queue < 0:
            raise ValueError(f"max_queue must be >= 0, got {max_queue}")
        self.max_queue = max_queue
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="mmadapt-model")
        self.lock = threading.Lock()
        self.pending = 0  # running + waiting
        self.running = False
        self.mean_seconds = 1.0  # an exponential mean of recent job times, for Retry-After
        self.counts = {"answered": 0, "cancelled": 0, "failed": 0}

    @property
    def waiting(self) -> int:
        with self.lock:
            return self.pending - int(self.running)

    def submit(self, job: Callable[[], Any]) -> Future:
        """Queue `job` (or raise `QueueFull`); its future holds what it returns or raises."""
        return self.reserve().submit(job)

    def reserve(self) -> Place:
        """A place in the queue (or `QueueFull`), held until it is submitted or released; it counts as waiting."""
        with self.lock:
            if self.pending >= self.max_queue + 1:
                raise QueueFull(self.pending - int(self.running), max(1, math.ceil(self.pending * self.mean_seconds)))
            self.pending += 1
        return Place(self)

    def _release(self) -> None:
        with self.lock:
            self.pending -= 1

    def _run(self, job: Callable[[], Any]) -> Any:
        with self.lock:
            self.running = True
        start = time.perf_counter()
        try:
            return job()
        finally:
            with self.lock:
                self.mean_seconds = 0.8 * self.mean_seconds + 0.2 * (time.perf_counter() - start)
                self.running = False
                self.pending -= 1

    def count(self, outcome: str) -> None:
        """Record how a request ended: answered, cancelled or failed."""
        with self.lock:
            self.counts[outcome] += 1

    def state(self) -> dict[str, Any]:
        with self.lock:
            return {"running": int(self.running), "waiting": self.pending - int(self.running),
                    "max_queue": self.max_queue, **self.counts}

    def shutdown(self) -> None:
        """Wait for the running job; drop those still waiting."""
        self.executor.shutdown(wait=True, cancel_futures=True)


class Place:
    """A place in the worker's queue (`ModelWorker.reserve`): `submit` one job into it, or `release` it."""

    def __init__(self, worker: ModelWorker) -> None:
        self.worker, self.used = worker, False

    def submit(self, job: Callable[[], Any]) -> Future:
        if self.used:
            raise RuntimeError("this queue place was already used")
        self.used = True
        return self.worker.executor.submit(self.worker._run, job)

    def release(self) -> None:
        """Give the place back unused (a request refused after it queued); a used place is left alone."""
        if not self.used:
            self.used = True
            self.worker._release()
