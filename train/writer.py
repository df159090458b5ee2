"""The trainer's writes (store commits, checkpoints) off the loop's critical path.

``Writes`` runs submitted jobs in submission order: on one background thread
(``background=True``), or at once on the caller's thread. The trainer submits an
iteration's commits and its checkpoint and goes on sampling the next iteration while they
run, then calls ``wait`` before anything that needs them done: before its first optimizer
step (the checkpoint reads the live weights and optimizer state), before the reuse stage
reads the store, and at the end of the run. So the files on disk appear in the same order
as with synchronous writes (iteration k's trees, credit and metrics, then checkpoint
``step-(k+1)``), and a ``kill -9`` loses at most what a kill during a synchronous write
would: a checkpoint is published only after its iteration's commits, which are keyed, so
a resume re-samples the lost iteration and commits it once.

Errors. The first job that raises stops the queue: the jobs after it are dropped and the
exception is raised again, unchanged, by the next ``submit``, ``wait`` or ``close``, so a
failed commit stops the run as it did when it ran inline, with the same message.

Cost. What a job runs in Rust or C without the GIL (delta-rs, Parquet encoding, fsync,
safetensors, hashing) overlaps the loop fully; the Python around it shares the GIL with
the loop, and the thread shares the machine's cores, so the loop's own phases run a
little slower while a write is in flight (benchmarks/bench_train_trl.py times the
iteration both ways: on 2 cores with the tiny model, 0.13 s of writes per iteration
left about 0.02-0.05 s on the loop's path).
"""

from __future__ import annotations

import queue
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

Job = Callable[[], Any]


class Writes:
    """Jobs run in submission order, on a background thread or inline (module docstring)."""

    def __init__(self, background: bool) -> None:
        self.background = background
        self.waited = 0.0  # seconds ``wait`` blocked the caller (a metric of the trainer)
        self._error: BaseException | None = None
        self._jobs: queue.SimpleQueue[Job | None] = queue.SimpleQueue()
        self._submitted = 0  # jobs numbered 1, 2, ... in submission order
        self._done = 0  # jobs run (or dropped after a failure), always a prefix
        self._changed = threading.Condition()
        self._thread: threading.Thread | None = None
        if background:
            self._thread = threading.Thread(target=self._run, name="rtrees-writes",
                                            daemon=True)
            self._thread.start()

    def _run(self) -> None:
        while (job := self._jobs.get()) is not None:
            try:
                if self._error is None:  # after a failure the rest is dropped
                    job()
            except BaseException as exc:  # handed to the caller's thread
                self._error = exc
            with self._changed:
                self._done += 1
                self._changed.notify_all()

    def _raise(self) -> None:
        if self._error is not None:
            self._stop()  # the jobs queued after the failure are dropped, not run
            error, self._error = self._error, None
            raise error

    def _stop(self) -> None:
        thread, self._thread = self._thread, None
        if thread is not None:
            self._jobs.put(None)
            thread.join()

    def submit(self, job: Job) -> int:
        """Run ``job`` after every job submitted before it (inline: now); its ticket for
        ``wait``."""
        self._raise()
        self._submitted += 1
        if self._thread is None:
            job()
            self._done = self._submitted
        else:
            self._jobs.put(job)
        return self._submitted

    def wait(self, ticket: int | None = None) -> None:
        """Block until job ``ticket`` and every job before it have run (None: every job
        submitted); raise the first failure."""
        target = self._submitted if ticket is None else ticket
        if self._thread is not None and self._done < target:
            start = time.perf_counter()
            with self._changed:
                self._changed.wait_for(lambda: self._done >= target)
            self.waited += time.perf_counter() - start
        self._raise()

    def close(self) -> None:
        """``wait``, then stop the thread."""
        self.wait()
        self.release()

    def release(self) -> None:
        """Let the queued jobs finish and stop the thread, raising nothing: on the way
        out of a run that already failed, a write's own failure is reported on stderr
        in one line rather than replacing the run's error."""
        self._stop()
        if self._error is not None:
            print(f"warning: a background write also failed: {self._error}", file=sys.stderr)
            self._error = None
