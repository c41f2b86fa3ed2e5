"""No specdec service computes beside a worker's calibration (common.startup_turn): every `specdec serve` shares the
machine's start-up lock from before its imports, a worker holds it alone while it calibrates and lets go once
calibrated, a coordinator once it has imported its modules."""

import fcntl
import os
import select
import subprocess
import sys

import pytest

from specdec.common import startup_turn
from specdec.coordinator.cluster import free_port, is_serving
from tests.support.waiting import wait_until

TARGET = "tiny-random:seed=0,vocab=256,layers=2,hidden=64"
SERVE = [sys.executable, "-m", "specdec.cli", "serve"]


def held_by_another_process(path) -> bool:
    with open(path, "a") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        fcntl.flock(handle, fcntl.LOCK_UN)
        return False


def start(role_args: list[str], lock, log) -> subprocess.Popen:
    env = {**os.environ, "SPECDEC_STARTUP_LOCK": str(lock)}
    return subprocess.Popen([*SERVE, *role_args], env=env, stdout=log, stderr=subprocess.STDOUT)


def stop(process: subprocess.Popen) -> None:
    process.terminate()
    try:
        process.wait(timeout=20)
    except subprocess.TimeoutExpired:
        process.kill()


def test_no_lock_is_taken_when_it_is_turned_off_and_a_lock_that_cannot_be_opened_does_not_stop_the_start(tmp_path):
    for path in ("none", None, str(tmp_path / "missing-folder" / "lock")):
        startup_turn.begin(path)
        assert startup_turn.held is None
        startup_turn.end()
    assert not list(tmp_path.iterdir())


def test_services_share_the_lock_while_starting_and_a_calibrating_worker_holds_it_alone(tmp_path):
    lock = tmp_path / "startup.lock"
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            f"from specdec.common import startup_turn; startup_turn.begin({str(lock)!r}); "
            "print('shared', flush=True); input(); startup_turn.alone(); print('alone', flush=True); input()",
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline() == "shared\n"
        startup_turn.begin(str(lock))  # another service starting beside it: granted at once
        assert startup_turn.held is not None
        holder.stdin.write("\n")
        holder.stdin.flush()  # it now wants the lock alone: it waits for this process to let go
        assert not select.select([holder.stdout], [], [], 0.5)[0]
        startup_turn.end()
        assert holder.stdout.readline() == "alone\n" and held_by_another_process(lock)
    finally:
        startup_turn.end()
        holder.kill()
        holder.wait()


@pytest.mark.slow
def test_a_worker_waits_for_the_lock_before_starting_and_serves_once_it_is_free(tmp_path):
    lock, log, port = tmp_path / "startup.lock", tmp_path / "target.log", free_port()
    startup_turn.begin(str(lock))
    startup_turn.alone()  # another worker is calibrating
    try:
        with open(log, "wb") as output:
            worker = start(["target", "--model", TARGET, "--port", str(port)], lock, output)
        try:
            wait_until(lambda: "waiting for another specdec service" in log.read_text(), timeout=60)
            assert not is_serving(f"localhost:{port}") and "loaded" not in log.read_text()
        finally:
            startup_turn.end()
        wait_until(lambda: is_serving(f"localhost:{port}"), timeout=60, interval=0.2)
        assert "loaded tiny-random" in log.read_text() and not held_by_another_process(lock)  # given up once loaded
    finally:
        startup_turn.end()
        stop(worker)


@pytest.mark.slow
def test_a_coordinator_gives_the_lock_up_once_imported_before_it_waits_for_its_workers(tmp_path):
    lock, log = tmp_path / "startup.lock", tmp_path / "coordinator.log"
    startup_turn.begin(str(lock))
    startup_turn.alone()
    try:
        with open(log, "wb") as output:  # its target never comes: it keeps waiting for it
            coordinator = start(["coordinator", "--port", str(free_port()), "--target", f"localhost:{free_port()}"], lock, output)
        wait_until(lambda: "waiting for another specdec service" in log.read_text(), timeout=60)
    finally:
        startup_turn.end()
    try:
        wait_until(lambda: "waited" in log.read_text(), timeout=60)  # it took the lock
        wait_until(lambda: not held_by_another_process(lock), timeout=60)  # and gave it up
        assert coordinator.poll() is None  # still waiting for its target
    finally:
        stop(coordinator)
