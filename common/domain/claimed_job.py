"""What a worker keeps of a job it claimed: the columns the claim's UPDATE returns, as a plain dataclass.

The grouped claim (common.domain.jobs.claim_many) returned ORM `Job` instances: every column loaded, each row put in
the session's identity map with its instance state, all under the worker's one GIL. While jobs trickle in, a
worker's claim groups hold one or two jobs, and there the ORM cost more than the round trip. With these columns
returned on a plain connection, a worker spends much less CPU per job on claim + finish (bench/state_writes.py,
docs/benchmarks.md).
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from datetime import datetime
from typing import Any

from common.domain.models import Job


@dataclass(frozen=True)
class ClaimedJob:
    id: str
    tenant: str
    model: str
    priority: int
    request: dict[str, Any]  # the normalised chat request (common/domain/submission.py)
    batch_id: str | None
    created_at: datetime
    attempts: int  # this attempt included

    @classmethod
    def of(cls, row: Any) -> ClaimedJob:
        """From a row the claim returned, or from a `Job`."""
        return cls(**{name: getattr(row, name) for name in CLAIMED_FIELDS})


CLAIMED_FIELDS = tuple(f.name for f in fields(ClaimedJob))
# The jobs table's columns of the same names, for RETURNING.
CLAIMED_COLUMNS = tuple(Job.__table__.c[name] for name in CLAIMED_FIELDS)
