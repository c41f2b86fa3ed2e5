"""Workers on one machine load and calibrate their models in turn.

A worker measures its cost curve when it loads (ModelRunner.cost_curve), and the coordinator's choice of gamma
starts from it. Two workers that start together on the same cores measure each other's load: the target's curve
then says 2 rows cost 1.6 steps, and a draft that steps in 0.3 of the target's time looks like 0.56 of it, so the
cost model never asks it (docs/results/). The coordinator corrects the target's curve from its rounds, but a
draft's only from rounds that draft: a draft whose curve was measured under load is never asked, and never
corrected. An exclusive lock on one file per machine and user (flock: released by the kernel when the process
dies) makes the second worker wait until the first serves.
"""

import contextlib
import fcntl
import logging
import os
import tempfile
import time

log = logging.getLogger("specdec")

NO_LOCK = "none"


def default_lock_path() -> str:
    return os.path.join(tempfile.gettempdir(), f"specdec-{os.getuid()}-startup.lock")


@contextlib.contextmanager
def startup_turn(path: str | None):
    """Holds the machine's start-up lock at `path` (None or "none": no lock) for the block, waiting for it first."""
    if not path or path == NO_LOCK:
        yield
        return
    try:
        handle = open(path, "a")  # noqa: SIM115 - closed below, after the lock
    except OSError as error:  # a lock that cannot be had must not keep the worker from serving
        log.warning("start-up lock %s unavailable (%s): loading without waiting for other workers", path, error)
        yield
        return
    with handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log.info("waiting for another worker on this machine to finish loading (%s)", path)
            start = time.monotonic()
            fcntl.flock(handle, fcntl.LOCK_EX)
            log.info("waited %.1f s for another worker's start-up", time.monotonic() - start)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)
