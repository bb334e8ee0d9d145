"""One Settings object for every vlmq process, read from `VLMQ_*` environment variables.

The defaults are the embedded configuration: SQLite file, in-process broker and a local object folder
under `data_dir`, so `vlmq run` works on a laptop with no services.
"""

from __future__ import annotations

import re
from functools import lru_cache
from pathlib import Path
from typing import Literal

from pydantic import Field, IPvAnyNetwork, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

# The bundled demo model (worker/demo/model): what a worker serves when no other model is named.
DEMO_MODEL = "vlmq-demo"


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="VLMQ_", env_file=".env", extra="ignore")

    data_dir: Path = Field(default=Path("~/.vlmq"), description="Root of embedded state (SQLite, objects).")

    # SQL: the source of truth for every job's state.
    database_url: str = Field(default="", description="SQLAlchemy URL; empty means SQLite under data_dir.")

    # Broker: only delivers; everything in it can be rebuilt from SQL.
    broker_url: str = Field(default="memory://", description="Celery broker; memory:// runs in-process.")
    broker_visibility_timeout: int = Field(default=43200, ge=1, description="Seconds before Redis redelivers.")

    # Object storage.
    storage_backend: Literal["local", "s3"] = "local"
    storage_dir: Path | None = Field(default=None, description="Local object folder; default data_dir/objects.")
    s3_endpoint_url: str | None = None
    s3_bucket: str = "vlmq"
    s3_region: str = "us-east-1"
    s3_access_key_id: str | None = None
    s3_secret_access_key: str | None = None
    s3_create_bucket: bool = True
    presign_expiry_seconds: int = Field(default=3600, ge=1, le=7 * 24 * 3600)

    # The model a worker serves; API accepts jobs for `model_name`.
    model: str = Field(default=DEMO_MODEL, description="HF model id or local path the worker loads; "
                       f"{DEMO_MODEL!r} is the bundled demo model.")
    served_model_name: str = Field(default="", description="Name clients use; default: model's folder name.")
    device: str = "cpu"
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"

    # Job state machine.
    lease_seconds: float = Field(default=300.0, gt=0)
    heartbeat_seconds: float = Field(default=0.0, ge=0, description="0 means lease_seconds / 3.")
    max_attempts: int = Field(default=3, ge=1)
    retry_backoff_seconds: float = Field(default=2.0, ge=0)
    # A generated result is worth keeping through an outage: the worker keeps trying to store it (and finish
    # the row) this long before giving the job back, instead of spending one of its attempts.
    persist_retry_seconds: float = Field(default=300.0, ge=0, description="How long a result waits out S3/SQL.")

    # Worker batching. "engine" is the paged continuous-batching engine; "hf" batches HF `generate` calls
    # (any HF VLM, less efficient); "auto" picks the engine when it supports the model's family; "null" prepares
    # each request as the engine would and answers at once, to measure the queue alone (bench/queue_ceiling.py).
    backend: Literal["auto", "engine", "hf", "null"] = "auto"
    worker_concurrency: int = Field(
        default=0, ge=0, description="Jobs one worker holds in flight; 0: twice max_num_seqs, so that the engine's "
                                     "batch is full from the start and a finished job's place is taken at once.")
    max_batch_size: int = Field(default=32, ge=1, description="Jobs per generation batch.")
    batch_wait_ms: float = Field(default=20.0, ge=0, description="How long to gather a batch once one arrives.")
    kv_block_size: int = Field(default=16, ge=1)
    kv_num_blocks: int | None = Field(default=None, ge=1, description="KV pool in blocks; default: a fraction.")
    kv_cache_fraction: float = Field(default=0.3, gt=0, le=0.95, description="Of free memory, for the KV pool.")
    max_num_seqs: int = Field(default=64, ge=1, description="Requests decoding together.")
    engine_step_linger_ms: float = Field(
        default=5.0, ge=0, le=1000,
        description="While jobs still arrive and the batch has room, wait up to this long for the next before an "
                    "engine step (fewer, fuller steps); 0: step at once.")
    max_num_batched_tokens: int = Field(default=2048, ge=1, description="Tokens per engine step.")
    max_encoder_items_per_step: int = Field(default=64, ge=1, description="Images per vision forward.")
    encoder_cache_tokens: int = Field(default=32768, ge=1, description="Image embeddings kept, in positions.")
    cpu_fast_paths: bool = Field(default=True, description="On CPU: C++ decode attention, oneDNN-packed linears, "
                                 "one-pass RMSNorm, SiLU-and-multiply and rotary embedding.")
    engine_compile: bool = Field(
        default=False, description="Compile the language model's decoder layers with torch.compile (inductor): "
        "fused element-wise ops, for more throughput on CPU, at the cost of compiling during the first steps "
        "(docs/benchmarks.md).")
    engine_process: bool = Field(
        default=True, description="Run the paged engine in a child process, so that its Python does not share a "
        "GIL with the worker's per-job work (delivery, SQL, S3, prompt encoding).")
    prepare_processes: int = Field(
        default=0, ge=0, le=64,
        description="Processes that prepare image jobs' inputs (fetch, decode, chat template, processor) for the "
        "paged engine, off the worker's one GIL (worker/jobs/prepare_pool.py). 0: in the job's own thread.")
    engine_nice: int = Field(
        default=5, ge=0, le=19,
        description="Niceness added to the engine process: where it shares CPUs with the per-job work that feeds "
                    "it (the worker's threads, the API, Postgres), that work goes first and the engine steps on "
                    "fuller batches; it still gets every CPU left idle. 0: the same priority.")

    image_resize: Literal["torch", "pillow"] = Field(
        default="torch", description="How the model's image processor resizes images: \"torch\", with torch's "
        "antialiased uint8 kernel, the resize of HF's torchvision-backed processors (faster preparation of "
        "photos, a pixel off by one now and then against Pillow); \"pillow\", with Pillow, as HF's PIL-backed "
        "processors do.")

    gc_freeze: bool = Field(
        default=True, description="Once a process has started (API, workers, the engine process), freeze its "
        "objects out of Python's garbage collector's scans (common/infra/heap.py): a full collection no longer walks "
        "the imported libraries and the loaded model, which would stop a busy worker while it did.")

    # Input limits.
    max_body_bytes: int = Field(default=32 * 1024 * 1024, ge=1024)
    body_idle_timeout_seconds: float = Field(
        default=30.0, gt=0, description="A request body (JSON or upload) that sends nothing for this long is cut "
        "off with 408.")
    max_image_bytes: int = Field(default=20 * 1024 * 1024, ge=1024)
    max_image_pixels: int = Field(default=40_000_000, ge=1)
    max_images_per_job: int = Field(default=16, ge=1)
    max_job_pixels: int = Field(
        default=100_000_000, ge=1, description="The pixels of one job's images together (width x height, summed). "
        "A job over it is refused at submission (400 too_many_pixels, or a batch line's error), and a worker "
        "checks again from the images' headers before decoding any: decoded, with the processor's copies, a "
        "pixel takes ~8 bytes of a worker's memory.")
    worker_prepare_pixels: int = Field(
        default=200_000_000, ge=1, description="Decoded pixels a worker's job threads hold at once while they "
        "prepare inputs (worker/inference/pixel_budget.py); later jobs wait their turn. A job over it runs when "
        "nothing else is held.")
    max_image_frames: int = Field(default=1000, ge=1, description="Animated images above this are refused.")
    max_tokens_limit: int = Field(default=4096, ge=1)
    max_job_messages: int = Field(
        default=1024, ge=1, description="Messages in one job's request, each part of a list content counted as one.")
    max_job_text_chars: int = Field(default=1_000_000, ge=1, description="Characters of text in one job's request.")
    default_max_tokens: int = Field(
        default=256, ge=1, description="Tokens a request that sets no max_tokens may generate, where the model's "
        "generation_config.json sets no max_new_tokens (the worker takes that one first).")
    allowed_image_formats: list[str] = Field(default_factory=lambda: ["JPEG", "PNG", "WEBP", "GIF", "BMP"])
    image_check: Literal["structure", "decode"] = Field(
        default="structure", description="How submission tells a corrupt image from a good one before accepting "
        "it: \"structure\" reads PNG and JPEG containers without decoding their pixels (every PNG chunk's "
        "checksum, every JPEG marker to the end of the image; far cheaper than decoding a photo) and "
        "decodes other formats; \"decode\" decodes every image. An image whose container is whole but whose "
        "compressed data is broken (crafted, in practice) passes \"structure\" and fails its job with "
        "invalid_input.")

    # Remote images: image parts may be https URLs, fetched at submission and stored like uploads. Off by
    # default: a URL chosen by a client makes this server send a request from inside its network, so every
    # address a host resolves to must be public (common/images/fetch.py) unless listed below.
    image_urls_enabled: bool = False
    image_url_allow_http: bool = Field(default=False, description="Also fetch plain http:// image URLs.")
    image_url_timeout_seconds: float = Field(default=10.0, gt=0, description="Whole fetch, redirects included.")
    image_url_max_redirects: int = Field(default=5, ge=0)
    image_url_allowed_networks: list[IPvAnyNetwork] = Field(
        default_factory=list, description="Networks exempt from the public-address rule (an internal image host).")

    # Image archives of native datasets (zip/tar), capped against archive bombs; a member is also capped by
    # max_image_bytes.
    archive_max_entries: int = Field(default=200_000, ge=1, description="Members (files, folders, links).")
    archive_max_total_bytes: int = Field(default=2 * 1024**3, ge=1024, description="All members, uncompressed.")
    archive_max_ratio: float = Field(default=100.0, gt=1,
                                     description="Uncompressed/compressed size of a member or a tar stream.")

    # OpenAI Files and Batches. A batch input line is held whole while it is checked, so it is capped by
    # max_body_bytes like a single job's body; the file itself is streamed and capped here.
    max_file_bytes: int = Field(default=200 * 1024 * 1024, ge=1024, description="Largest POST /v1/files upload.")
    batch_priority: int = Field(default=2, ge=0, le=9, description="Priority of batch jobs (/v1/jobs default: 5).")
    # POST /v1/chat/completions answers once its job ends; past this it answers 504 with the job's id, and the
    # job carries on (poll GET /v1/jobs/{id}). Below the openai client's own 600 s timeout.
    chat_wait_seconds: float = Field(default=300.0, gt=0, description="How long a chat completion waits for its "
                                     "job before a 504 that names the job.")
    # 2,000: per-chunk costs (commit, resume point, dispatch top-up) fade below the per-line ones, while a
    # chunk holds only normalised requests (images are hashes), a few MB (bench/ingest.py).
    ingest_chunk_rows: int = Field(default=2000, ge=1, description="Input lines per ingest transaction.")
    # The first chunk is small and each next one doubles up to ingest_chunk_rows: workers start on a batch's
    # first jobs once 64 lines are checked, not 2,000, and the few extra transactions are spent only at the
    # start.
    ingest_first_chunk_rows: int = Field(default=64, ge=1, description="Input lines in an ingestion's first "
                                         "transaction; each next one doubles, up to ingest_chunk_rows.")
    image_pack_bytes: int = Field(
        default=16 * 1024 * 1024, ge=0, description="Most bytes of new images an ingestion writes as one object, a "
        "pack (common/images/pack.py), so that workers read a chunk's images with one request; 0 stores each image "
        "as an object of its own.")
    ingest_concurrency: int = Field(default=4, ge=1, description="Tasks a `vlmq ingest-worker` runs at once.")
    # Fair sharing: SQL holds every queued job; the broker gets at most this many of one tenant's jobs of one
    # model at a time (sent or running), refilled as they finish, so a tenant with a million queued rows holds
    # a window of the queue, not all of it. Size it above the jobs all workers of a model hold in flight.
    dispatch_window: int = Field(default=2048, ge=1, description="Jobs per tenant and model in the broker.")
    # Jobs sent together (a batch's chunks, POSTs written in one transaction) share run_job messages: Celery's
    # receipt, task call and ack cost a worker CPU per message, not per job (bench/celery_messages.py). A worker
    # counts such a message as that many of its `worker_concurrency` slots, so it holds no more jobs. Sized by
    # what the engine holds: a quarter of max_num_seqs, so that a batch's rows come a few messages to an engine
    # step (and tenants share a batch at that grain) while a large engine costs few messages per step.
    job_ids_per_message: int = Field(
        default=0, ge=0, le=256, description="Most jobs one run_job message carries; 0: a quarter of max_num_seqs "
                                             "(at most worker_concurrency).")
    # Maintenance (Celery beat, `vlmq beat` or `vlmq ingest-worker --beat`): reap expired leases, send again
    # what the broker lost, top up dispatch windows, expire and finalize batches.
    sweep_interval_seconds: float = Field(default=30.0, gt=0, description="How often the sweep runs.")
    republish_grace_seconds: float = Field(default=60.0, ge=0,
                                           description="A sent job missing from the broker this long is resent.")

    # Access: bearer API keys per tenant (`vlmq apikey create --tenant NAME`). "auto" requires them except
    # in embedded mode (in-process broker), the only mode where they may be off.
    auth: Literal["auto", "on", "off"] = "auto"
    auth_cache_seconds: float = Field(default=10.0, ge=0, description="How long a checked key is trusted.")
    tenant_requests_per_second: int = Field(default=0, ge=0, description="Per tenant, all API replicas; 0: off.")
    tenant_max_open_jobs: int = Field(default=0, ge=0, description="Queued+running jobs per tenant; 0: no limit.")

    # Observability. The status page (/status) shows a key's own tenant; keys of these tenants see them all.
    admin_tenants: list[str] = Field(default_factory=list, description="Tenants whose keys see every tenant.")
    log_format: Literal["text", "json"] = Field(default="text", description="json: one JSON object per line.")
    metrics_enabled: bool = Field(default=True, description="Serve Prometheus metrics at the API's /metrics.")
    metrics_port: int = Field(default=0, ge=0, le=65535, description="A worker's Prometheus port; 0: none.")
    # Every worker, ingest worker and beat publishes a short-lived record (broker Redis) for the status page
    # and the container healthchecks; it disappears 3 intervals after the process stops publishing.
    stats_interval_seconds: float = Field(default=5.0, gt=0, description="How often processes publish stats.")

    @field_validator("data_dir", "storage_dir")
    @classmethod
    def _expand(cls, value: Path | None) -> Path | None:
        return value.expanduser() if value is not None else None

    @field_validator("allowed_image_formats")
    @classmethod
    def _upper(cls, value: list[str]) -> list[str]:
        return [v.strip().upper() for v in value if v.strip()]

    @model_validator(mode="after")
    def _fill_derived(self) -> Settings:
        if not self.database_url:
            self.database_url = f"sqlite:///{self.data_dir / 'vlmq.db'}"
        if self.storage_dir is None:
            self.storage_dir = self.data_dir / "objects"
        if not self.served_model_name and self.model:
            self.served_model_name = Path(self.model.rstrip("/")).name or self.model
        if self.worker_concurrency == 0:
            self.worker_concurrency = 2 * self.max_num_seqs
        if self.job_ids_per_message == 0:
            self.job_ids_per_message = max(1, min(256, self.max_num_seqs // 4, self.worker_concurrency))
        if self.heartbeat_seconds == 0:
            self.heartbeat_seconds = self.lease_seconds / 3
        if self.heartbeat_seconds >= self.lease_seconds:
            raise ValueError("heartbeat_seconds must be shorter than lease_seconds")
        if self.auth == "off" and not self.embedded_broker:
            raise ValueError("auth may be off only in embedded mode (broker_url memory://); create API keys "
                             "with `vlmq apikey create --tenant NAME`")
        return self

    @property
    def embedded_broker(self) -> bool:
        return self.broker_url.startswith("memory://")

    @property
    def auth_required(self) -> bool:
        return self.auth == "on" or (self.auth == "auto" and not self.embedded_broker)

    @property
    def job_queue(self) -> str:
        """Each served model has its own queue, so workers of different models never steal jobs."""
        return "jobs." + re.sub(r"[^A-Za-z0-9_.-]", "_", self.served_model_name or "default")


@lru_cache(maxsize=1)
def get_settings() -> Settings:
    return Settings()
