"""specdec services on one machine never compute beside a worker's calibration.

A worker measures its cost curve when it loads (ModelRunner.cost_curve), and the coordinator's choice of gamma
starts from it. A worker that calibrates while another process computes measures that process's load, and a draft
whose curve says it is slower than it is may never be asked
(docs/results/2026-12-07-start-up-lock-and-the-qwen-drafts.md); a coordinator importing its modules beside the
calibration inflates it too. So every `specdec serve` shares one lock per machine and user from before its imports
(flock: the kernel releases it when the process dies); a worker holds it alone while it calibrates, which waits for
the others' imports and loads to finish and keeps new ones from starting; a coordinator lets go once imported, a
worker once calibrated. Imports and loads still overlap each other.
"""

import fcntl
import logging
import os
import tempfile
import time
from typing import IO

log = logging.getLogger("specdec")

NO_LOCK = "none"
held: IO | None = None  # this process's lock, while it holds it (shared, or alone while calibrating)


def default_lock_path() -> str:
    return os.path.join(tempfile.gettempdir(), f"specdec-{os.getuid()}-startup.lock")


def take(handle: IO, mode: int, waiting_for: str) -> None:
    try:
        fcntl.flock(handle, mode | fcntl.LOCK_NB)
    except BlockingIOError:
        log.info("waiting for %s (%s)", waiting_for, handle.name)
        start = time.monotonic()
        fcntl.flock(handle, mode)
        log.info("waited %.1f s for %s", time.monotonic() - start, waiting_for)


def begin(path: str | None) -> None:
    """Shares the machine's start-up lock at `path` (None or "none": no lock), waiting while a worker calibrates;
    nothing if this process holds it already. A lock that cannot be opened is logged and skipped: it must not keep a
    service from starting."""
    global held
    if held is not None or not path or path == NO_LOCK:
        return
    try:
        handle = open(path, "a")  # noqa: SIM115 - kept open while held, closed by end()
    except OSError as error:
        log.warning("start-up lock %s unavailable (%s): starting without waiting for other services", path, error)
        return
    take(handle, fcntl.LOCK_SH, "another specdec service on this machine to finish calibrating")
    held = handle


def alone() -> None:
    """Holds the lock alone (nothing if this process does not hold it): until end(), no other specdec service on this
    machine imports, loads or calibrates."""
    if held is not None:
        take(held, fcntl.LOCK_EX, "the other specdec services on this machine to finish starting")


def end() -> None:
    """Lets go of the lock (nothing if not held)."""
    global held
    if held is not None:
        handle, held = held, None
        fcntl.flock(handle, fcntl.LOCK_UN)
        handle.close()
