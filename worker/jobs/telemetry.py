"""What a model worker tells the outside: Prometheus metrics (its own port) and a live record in the registry
(status page, healthcheck), both read from the engine's counters and the jobs this process finished.

Nothing here runs on the engine thread: counters are read when scraped or published, so observing costs the
engine nothing.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector

from common.broker.queue import TASK_RUN_JOB
from common.infra.gc_pauses import GcPauseCollector
from common.infra.settings import Settings
from common.infra.worker_registry import Heartbeat, WorkerRegistry
from worker.engine import vision_batches
from worker.jobs.leases import LeaseKeeper
from worker.jobs.stage_clock import StageClock

if TYPE_CHECKING:
    from worker.jobs.prepare_pool import PreparePool

VISION_BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
_COUNTERS = {  # engine counter -> (metric name, help)
    "prefix_cache_query_tokens": ("vlmq_engine_prefix_cache_query_tokens", "Prompt tokens looked up in the cache."),
    "prefix_cache_hit_tokens": ("vlmq_engine_prefix_cache_hit_tokens", "Prompt tokens found in the prefix cache."),
    "encoder_cache_hits": ("vlmq_engine_encoder_cache_hits", "Images whose embeddings were cached."),
    "encoder_cache_misses": ("vlmq_engine_encoder_cache_misses", "Images encoded by the vision tower."),
    "generated_tokens": ("vlmq_engine_generated_tokens", "Tokens generated."),
    "preemptions": ("vlmq_engine_preemptions", "Requests preempted for lack of KV blocks."),
    "steps": ("vlmq_engine_steps", "Engine steps."),
    "prefill_step_seconds": ("vlmq_engine_prefill_step_seconds",
                             "Wall time of engine steps that computed prompt tokens (any with decodes beside)."),
    "decode_step_seconds": ("vlmq_engine_decode_step_seconds", "Wall time of engine steps that only decoded."),
}
_GAUGES = {
    "requests_running": ("vlmq_engine_requests_running", "Requests scheduled (prefilling or decoding)."),
    "requests_waiting": ("vlmq_engine_requests_waiting", "Requests waiting for KV blocks or a slot."),
    "kv_blocks_used": ("vlmq_engine_kv_blocks_used", "KV cache blocks in use."),
    "kv_blocks_free": ("vlmq_engine_kv_blocks_free", "KV cache blocks free."),
}


def _ratio(part: float, whole: float) -> float:
    return part / whole if whole else 0.0


class WorkerTelemetry:
    def __init__(self, settings: Settings, generator: object, leases: LeaseKeeper, worker_id: str,
                 clock: StageClock | None = None, prepare_pool: PreparePool | None = None) -> None:
        self.settings, self.generator, self.leases, self.worker_id = settings, generator, leases, worker_id
        self.clock = clock
        self.prepare_pool = prepare_pool
        self.jobs: Counter[str] = Counter()  # this process's run_job outcomes by status
        self._lock = threading.Lock()
        self._vision_buckets = [0] * (len(VISION_BATCH_BUCKETS) + 1)
        self._vision_sum = 0
        self._last: tuple[float, float, int] | None = None  # (time, generated tokens, jobs done)
        self.tokens_per_s = 0.0
        self.jobs_per_s = 0.0
        self.registry = CollectorRegistry()
        self.registry.register(_Collector(self))
        self.registry.register(GcPauseCollector())
        self._heartbeat: Heartbeat | None = None
        self._server: Any = None

    # -- inputs ---------------------------------------------------------------------------------------
    def start(self) -> WorkerTelemetry:
        from celery.signals import task_postrun

        task_postrun.connect(self._on_task_done, weak=False)
        self._heartbeat = Heartbeat(WorkerRegistry(self.settings.broker_url), "worker",
                                    self.settings.stats_interval_seconds, self.record, process=self.worker_id)
        self._heartbeat.start()
        return self

    def _on_task_done(self, sender: Any = None, retval: Any = None, **_: object) -> None:
        # run_job returns the job's status after this attempt, or a list for a message of several (a retry
        # raises instead); "skipped" duplicates are counted too, since they show how often the broker redelivers.
        if getattr(sender, "name", None) != TASK_RUN_JOB:
            return
        statuses = [retval] if isinstance(retval, str) else retval if isinstance(retval, list) else []
        with self._lock:
            self.jobs.update(status for status in statuses if isinstance(status, str))

    def serve(self, port: int) -> None:
        """Prometheus /metrics on `port` (all interfaces: scraped from other hosts)."""
        self._server = start_http_server(port, registry=self.registry)

    def close(self) -> None:
        from celery.signals import task_postrun

        task_postrun.disconnect(self._on_task_done)
        if self._heartbeat is not None:
            self._heartbeat.close()
        if self._server is not None:
            self._server[0].shutdown()

    # -- outputs --------------------------------------------------------------------------------------
    def engine_metrics(self) -> dict[str, float]:
        metrics = getattr(self.generator, "metrics", None)
        return dict(metrics()) if callable(metrics) else {}

    def vision_batches(self) -> tuple[list[int], int, int]:
        """Cumulative histogram buckets, count and sum of vision batch sizes, fed from the runner's list."""
        sizes = getattr(self.generator, "vision_batch_sizes", None) or []
        with self._lock:
            for size in vision_batches.take(sizes):
                index = next((i for i, le in enumerate(VISION_BATCH_BUCKETS) if size <= le), len(VISION_BATCH_BUCKETS))
                self._vision_buckets[index] += 1
                self._vision_sum += size
            buckets = list(self._vision_buckets)
            total = self._vision_sum
        cumulative, running = [], 0
        for n in buckets:
            running += n
            cumulative.append(running)
        return cumulative, running, total

    def record(self) -> dict[str, Any]:
        """The registry record: identity, load and recent throughput (rates over the last interval)."""
        m = self.engine_metrics()
        now, tokens = time.monotonic(), float(m.get("generated_tokens", 0))
        with self._lock:
            done = sum(n for status, n in self.jobs.items() if status != "skipped")
            jobs = dict(self.jobs)
            if self._last is not None and now > self._last[0]:
                elapsed = now - self._last[0]
                self.tokens_per_s = max(0.0, tokens - self._last[1]) / elapsed
                self.jobs_per_s = max(0, done - self._last[2]) / elapsed
            self._last = (now, tokens, done)
        blocks = m.get("kv_blocks_used", 0) + m.get("kv_blocks_free", 0)
        return {
            "model": self.settings.served_model_name, "queue": self.settings.job_queue,
            "device": self.settings.device, "jobs_in_flight": len(self.leases.held()), "jobs": jobs,
            "jobs_done": done, "jobs_per_s": round(self.jobs_per_s, 3), "tokens_per_s": round(self.tokens_per_s, 2),
            "generated_tokens": int(tokens), "requests_running": int(m.get("requests_running", 0)),
            "requests_waiting": int(m.get("requests_waiting", 0)), "kv_blocks_used": int(m.get("kv_blocks_used", 0)),
            "kv_blocks_total": int(blocks),
            "prefix_cache_hit_rate": round(_ratio(m.get("prefix_cache_hit_tokens", 0),
                                                  m.get("prefix_cache_query_tokens", 0)), 3),
            "encoder_cache_hit_rate": round(_ratio(m.get("encoder_cache_hits", 0), m.get("encoder_cache_hits", 0)
                                                   + m.get("encoder_cache_misses", 0)), 3),
        }


class _Collector(Collector):
    def __init__(self, telemetry: WorkerTelemetry) -> None:
        self.t = telemetry

    def collect(self) -> Iterator[Any]:
        t = self.t
        info = GaugeMetricFamily("vlmq_worker_info", "This worker process.", labels=["worker_id", "model", "device"])
        info.add_metric([t.worker_id, t.settings.served_model_name, t.settings.device], 1)
        yield info
        jobs = CounterMetricFamily("vlmq_worker_jobs", "run_job outcomes in this process.", labels=["status"])
        with t._lock:
            for status, n in sorted(t.jobs.items()):
                jobs.add_metric([status], n)
        yield jobs
        yield GaugeMetricFamily("vlmq_worker_jobs_in_flight", "Jobs this process holds leases on.",
                                value=len(t.leases.held()))
        if t.clock is not None:
            cpu = CounterMetricFamily("vlmq_worker_stage_cpu_seconds",
                                      "CPU the job threads spent in each stage of a job (their own, not waits).",
                                      labels=["stage"])
            calls = CounterMetricFamily("vlmq_worker_stage_calls", "Times a job thread entered each stage.",
                                        labels=["stage"])
            for stage, (seconds, n) in t.clock.snapshot().items():
                cpu.add_metric([stage], seconds)
                calls.add_metric([stage], n)
            yield cpu
            yield calls
        if t.prepare_pool is not None:
            yield GaugeMetricFamily("vlmq_worker_prepare_processes", "Processes preparing image jobs' inputs.",
                                    value=t.prepare_pool.num_processes)
            yield CounterMetricFamily("vlmq_worker_prepare_pool_restarts",
                                      "Prepare pools replaced after one of their processes died.",
                                      value=t.prepare_pool.num_replaced)
        m = t.engine_metrics()
        if not m:
            return  # the HF fallback backend has no engine counters
        for key, (name, doc) in _GAUGES.items():
            yield GaugeMetricFamily(name, doc, value=m.get(key, 0))
        for key, (name, doc) in _COUNTERS.items():
            yield CounterMetricFamily(name, doc, value=m.get(key, 0))
        yield GaugeMetricFamily("vlmq_engine_prefix_cache_hit_rate", "Prefix cache hits / prompt tokens looked up.",
                                value=_ratio(m.get("prefix_cache_hit_tokens", 0),
                                             m.get("prefix_cache_query_tokens", 0)))
        yield GaugeMetricFamily("vlmq_engine_encoder_cache_hit_rate", "Encoder cache hits / images looked up.",
                                value=_ratio(m.get("encoder_cache_hits", 0),
                                             m.get("encoder_cache_hits", 0) + m.get("encoder_cache_misses", 0)))
        yield GaugeMetricFamily("vlmq_engine_generated_tokens_per_second",
                                "Tokens generated per second over the last stats interval.", value=t.tokens_per_s)
        cumulative, _, total = t.vision_batches()
        bounds = [str(float(le)) for le in VISION_BATCH_BUCKETS] + ["+Inf"]
        yield HistogramMetricFamily("vlmq_engine_vision_batch_size", "Images per vision forward.",
                                    buckets=list(zip(bounds, cumulative, strict=True)), sum_value=total)
