"""The object store a service process is about to use, checked once at its start (`vlmq api`, `vlmq worker`,
`vlmq ingest-worker`): a missing or refused S3 credential, or a bucket that is not there, is a line saying
which setting to fix, not a botocore traceback from the first request.

An endpoint that does not answer is fatal only where the process would create the bucket (its first request,
which failed with a traceback before); otherwise the process starts and waits it out, as it does a database
or an S3 outage later in its life.
"""

from __future__ import annotations

import logging

from botocore.exceptions import BotoCoreError, ClientError, NoCredentialsError, PartialCredentialsError

from common.infra.settings import Settings
from common.infra.storage import S3ObjectStore, store_connections

log = logging.getLogger(__name__)

_REFUSED_CREDENTIALS = frozenset({"InvalidAccessKeyId", "SignatureDoesNotMatch", "AccessDenied", "403",
                                  "Forbidden", "InvalidToken", "ExpiredToken"})
_NO_BUCKET = frozenset({"NoSuchBucket", "404", "NotFound"})
_CREDENTIALS = "VLMQ_S3_ACCESS_KEY_ID and VLMQ_S3_SECRET_ACCESS_KEY"


def object_store_problem(settings: Settings) -> str | None:
    """Why this process cannot use its object store, in one line; None when it can (or it is a local folder)."""
    if settings.storage_backend != "s3":
        return None
    where = settings.s3_endpoint_url or "AWS S3"
    try:
        # Few attempts: a start-up check should answer in seconds; the process's own client keeps retrying.
        store = S3ObjectStore(settings.s3_bucket, endpoint_url=settings.s3_endpoint_url, region=settings.s3_region,
                              access_key_id=settings.s3_access_key_id,
                              secret_access_key=settings.s3_secret_access_key,
                              create_bucket=settings.s3_create_bucket,
                              max_connections=store_connections(settings), max_attempts=2)
        store.check()
    except (NoCredentialsError, PartialCredentialsError):
        return f"no S3 credentials for {where}: set {_CREDENTIALS}"
    except ClientError as exc:
        error = exc.response.get("Error", {})
        code, message = str(error.get("Code", "")), error.get("Message") or ""
        if code in _REFUSED_CREDENTIALS:
            detail = f"{code}: {message}" if message else code
            return f"{where} refused the S3 credentials ({detail}): check {_CREDENTIALS}"
        if code in _NO_BUCKET:
            return (f"bucket {settings.s3_bucket!r} does not exist at {where}: create it, or set "
                    "VLMQ_S3_CREATE_BUCKET=true")
        return f"{where} answered {code or 'an error'} {message} for bucket {settings.s3_bucket!r}".rstrip()
    except ValueError as exc:  # botocore's "Invalid endpoint"
        return f"VLMQ_S3_ENDPOINT_URL {settings.s3_endpoint_url!r} is not usable: {exc}"
    except BotoCoreError as exc:  # connection refused, timed out, name not resolved
        if not settings.s3_create_bucket:
            log.warning("cannot reach S3 at %s yet (%s); starting anyway", where, exc)
            return None
        return f"cannot reach S3 at {where} ({exc}): is VLMQ_S3_ENDPOINT_URL right and the server up?"
    return None
