"""worker/jobs/telemetry.py: the worker's metrics, here the histogram of vision batch sizes."""

from __future__ import annotations

from types import SimpleNamespace

from common.infra.settings import Settings
from worker.jobs.telemetry import WorkerTelemetry


def test_vision_batch_sizes_are_counted_once_and_not_kept() -> None:
    """Each scrape counts the sizes reported since the last and takes them out of the generator's list, which
    so stays short however long the worker runs; the histogram itself is cumulative."""
    generator = SimpleNamespace(vision_batch_sizes=[1, 3, 3])
    telemetry = WorkerTelemetry(Settings(), generator, leases=None, worker_id="w")  # type: ignore[arg-type]
    _, count, total = telemetry.vision_batches()
    assert (count, total) == (3, 7) and generator.vision_batch_sizes == []
    generator.vision_batch_sizes.extend([8, 1])
    buckets, count, total = telemetry.vision_batches()
    assert (count, total) == (5, 16) and generator.vision_batch_sizes == []
    assert buckets[-1] == 5  # cumulative: the last bucket counts every forward
    assert telemetry.vision_batches()[1:] == (5, 16)
