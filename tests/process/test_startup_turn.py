"""Workers on one machine load and calibrate their models in turn (common.startup_turn), so that neither's cost curve
measures the other's load."""

import os
import subprocess
import sys
import threading

import pytest

from specdec.common.startup_turn import startup_turn
from specdec.coordinator.cluster import free_port, is_serving
from tests.support.waiting import wait_until

TARGET = "tiny-random:seed=0,vocab=256,layers=2,hidden=64"


def test_a_second_holder_of_the_startup_lock_enters_only_after_the_first_leaves(tmp_path):
    path, entered, release = str(tmp_path / "lock"), [], threading.Event()

    def first():
        with startup_turn(path):
            entered.append("first")
            release.wait(10)
        entered.append("first left")

    def second():
        with startup_turn(path):
            entered.append("second")

    threads = [threading.Thread(target=first)]
    threads[0].start()
    wait_until(lambda: entered == ["first"])
    threads.append(threading.Thread(target=second))
    threads[1].start()
    threads[1].join(0.5)
    assert entered == ["first"]  # the second is still waiting
    release.set()
    for thread in threads:
        thread.join(10)
    assert entered == ["first", "first left", "second"]


def test_no_lock_is_taken_when_it_is_turned_off_and_a_lock_that_cannot_be_opened_does_not_stop_the_start(tmp_path):
    entered = []
    with startup_turn("none"), startup_turn("none"), startup_turn(None):
        entered.append("off")
    with startup_turn(str(tmp_path / "missing-folder" / "lock")):
        entered.append("unopenable")
    assert entered == ["off", "unopenable"] and not list(tmp_path.iterdir())


@pytest.mark.slow
def test_a_worker_waits_for_the_lock_before_loading_and_serves_once_it_is_free(tmp_path):
    lock, log, port = tmp_path / "startup.lock", tmp_path / "target.log", free_port()
    with startup_turn(str(lock)), open(log, "wb") as output:  # another worker is loading
        worker = subprocess.Popen(
            [sys.executable, "-m", "specdec.cli", "serve", "target", "--model", TARGET, "--port", str(port)],
            env={**os.environ, "SPECDEC_STARTUP_LOCK": str(lock)},
            stdout=output,
            stderr=subprocess.STDOUT,
        )
        try:
            wait_until(lambda: "waiting for another worker" in log.read_text(), timeout=60)
            assert not is_serving(f"localhost:{port}") and "loaded" not in log.read_text()
        except BaseException:
            worker.kill()
            raise
    try:
        wait_until(lambda: is_serving(f"localhost:{port}"), timeout=60, interval=0.2)
        assert "loaded tiny-random" in log.read_text()
    finally:
        worker.terminate()
        worker.wait(timeout=20)
