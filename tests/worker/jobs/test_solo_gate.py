"""SoloGate: a job's last attempt runs with nothing beside it, and does not starve behind a stream of others."""

from __future__ import annotations

import threading
import time

from worker.jobs.solo_gate import SoloGate


def test_solo_waits_for_shared_runs_and_blocks_new_ones() -> None:
    gate = SoloGate()
    events: list[str] = []
    lock = threading.Lock()
    first_in = threading.Event()

    def shared(name: str, hold: float, started: threading.Event | None = None) -> None:
        with gate.shared():
            with lock:
                events.append(f"{name} in")
            if started is not None:
                started.set()
            time.sleep(hold)
            with lock:
                events.append(f"{name} out")

    def solo() -> None:
        with gate.solo():
            with lock:
                events.append("solo in")
            time.sleep(0.05)
            with lock:
                events.append("solo out")

    a = threading.Thread(target=shared, args=("a", 0.2, first_in))
    a.start()
    first_in.wait(5)
    s = threading.Thread(target=solo)
    s.start()
    time.sleep(0.05)  # the solo run is waiting now; a later shared run must queue behind it
    b = threading.Thread(target=shared, args=("b", 0.0))
    b.start()
    for t in (a, s, b):
        t.join(5)
    assert events == ["a in", "a out", "solo in", "solo out", "b in", "b out"]


def test_shared_runs_overlap() -> None:
    gate = SoloGate()
    inside = threading.Barrier(3, timeout=5)

    def shared() -> None:
        with gate.shared():
            inside.wait()  # all three inside at once, or the barrier times out

    threads = [threading.Thread(target=shared) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(5)
    assert not inside.broken
