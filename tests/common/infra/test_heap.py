"""Freezing a process's start-up heap: what start-up built leaves the garbage collector's scans, garbage made
afterwards is still collected. Run in a child process, since a freeze is for the whole process's life."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.stack import ROOT

_PROBE = """
import gc, json
import sqlalchemy, celery, common.infra.settings  # a start-up's worth of objects
from common.infra.heap import freeze_startup_heap

tracked_before = len(gc.get_objects())
frozen = freeze_startup_heap()
scanned_after = len(gc.get_objects())

class Node:
    pass

collected = []
def on_gc(phase, info):
    if phase == "stop":
        collected.append(info["collected"])
gc.callbacks.append(on_gc)
for _ in range(100):  # cycles made after the freeze: unreachable, only the collector can free them
    a, b = Node(), Node()
    a.other, b.other = b, a
del a, b
gc.collect()
print(json.dumps({"tracked_before": tracked_before, "frozen": frozen, "freeze_count": gc.get_freeze_count(),
                  "scanned_after": scanned_after, "collected": sum(collected)}))
"""


def test_start_up_objects_leave_the_scans_and_later_garbage_is_still_collected() -> None:
    out = subprocess.run([sys.executable, "-c", _PROBE], cwd=ROOT, capture_output=True, text=True, timeout=120,
                         check=True)
    probe = json.loads(out.stdout.splitlines()[-1])
    assert probe["frozen"] == probe["freeze_count"] > 0.9 * probe["tracked_before"] > 10_000
    # What a full collection walks now: the few objects made since, not the libraries.
    assert probe["scanned_after"] < 0.01 * probe["frozen"]
    assert probe["collected"] >= 200  # 100 cycles of two nodes (and their __dict__s)
