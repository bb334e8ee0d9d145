"""The retry of a job's calls to SQL and object storage, shared by the job thread and the prepare pool."""

from __future__ import annotations

from tenacity import retry, retry_if_not_exception_type, stop_after_attempt, wait_exponential

from common.infra.storage import ObjectNotFound

# Transient infrastructure errors (S3 or SQL blips) are retried in place a few times before the job is
# handed back to the queue.
infra_retry = retry(
    retry=retry_if_not_exception_type(ObjectNotFound),
    stop=stop_after_attempt(4),
    wait=wait_exponential(multiplier=0.2, max=3),
    reraise=True,
)
