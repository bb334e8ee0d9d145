"""The garbage collector's pauses, counted per generation and exported to Prometheus."""

from __future__ import annotations

import gc

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from common.infra.gc_pauses import GcPauseCollector, gc_pause_clock


def _values(registry: CollectorRegistry) -> dict[tuple[str, str], float]:
    return {(s.name, s.labels.get("generation", "")): s.value
            for family in text_string_to_metric_families(generate_latest(registry).decode())
            for s in family.samples}


def test_a_full_collection_is_counted_and_timed_in_every_registry() -> None:
    first, second = CollectorRegistry(), CollectorRegistry()
    first.register(GcPauseCollector())
    second.register(GcPauseCollector())  # one process, one callback, however many registries read it
    assert sum(cb == gc_pause_clock()._on_gc for cb in gc.callbacks) == 1
    before = _values(first)
    gc.collect()
    gc.collect()
    after = _values(first)
    assert after[("vlmq_gc_pauses_total", "2")] >= before[("vlmq_gc_pauses_total", "2")] + 2
    assert after[("vlmq_gc_pause_seconds_total", "2")] > before[("vlmq_gc_pause_seconds_total", "2")]
    assert _values(second)[("vlmq_gc_pauses_total", "2")] >= after[("vlmq_gc_pauses_total", "2")]
    assert {g for name, g in after if name.startswith("vlmq_gc_pause")} == {"0", "1", "2"}
    assert after[("vlmq_gc_frozen_objects", "")] == gc.get_freeze_count()  # nothing frozen in the test process
