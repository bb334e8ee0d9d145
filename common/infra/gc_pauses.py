"""How long this process's garbage collections stopped it, by generation, for Prometheus.

A collection runs in whichever thread allocated last and holds the GIL throughout, so its length is time the
process did nothing else. Full collections over a large heap stopped a busy worker for long stretches before
start-up heaps were frozen (common/infra/heap.py); `vlmq_gc_pause_seconds_total{generation="2"}` is how a deployment
sees that the freeze holds. prometheus-client's own GC collector counts collections but not their length.
"""

from __future__ import annotations

import gc
import threading
import time
from collections.abc import Iterator
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

GENERATIONS = (0, 1, 2)


class GcPauseClock:
    """Process-wide: one gc callback, installed once, however many registries read it."""

    def __init__(self) -> None:
        self.seconds = [0.0] * len(GENERATIONS)
        self.collections = [0] * len(GENERATIONS)
        self._started: float | None = None

    def _on_gc(self, phase: str, info: dict[str, int]) -> None:
        # Callbacks run inside the collection, under the GIL: no lock needed, and they must stay cheap.
        if phase == "start":
            self._started = time.perf_counter()
        elif self._started is not None:
            generation = info["generation"]
            self.seconds[generation] += time.perf_counter() - self._started
            self.collections[generation] += 1
            self._started = None


_clock: GcPauseClock | None = None
_install_lock = threading.Lock()


def gc_pause_clock() -> GcPauseClock:
    """This process's clock, its callback installed on first use."""
    global _clock
    with _install_lock:
        if _clock is None:
            _clock = GcPauseClock()
            gc.callbacks.append(_clock._on_gc)
        return _clock


class GcPauseCollector(Collector):
    def __init__(self) -> None:
        self.clock = gc_pause_clock()

    def collect(self) -> Iterator[Any]:
        seconds = CounterMetricFamily("vlmq_gc_pause_seconds", "Time this process spent in garbage collections "
                                      "(the GIL held throughout), by generation.", labels=["generation"])
        count = CounterMetricFamily("vlmq_gc_pauses", "Garbage collections this process ran, by generation.",
                                    labels=["generation"])
        for generation in GENERATIONS:
            seconds.add_metric([str(generation)], self.clock.seconds[generation])
            count.add_metric([str(generation)], self.clock.collections[generation])
        yield seconds
        yield count
        yield GaugeMetricFamily("vlmq_gc_frozen_objects", "Objects frozen out of the collector's scans at start-up "
                                "(VLMQ_GC_FREEZE, common/infra/heap.py).", value=gc.get_freeze_count())
