"""A process's first request served as fast as its later ones: what it keeps for its life is made at start.

A fresh API or ingest worker used to pay, on its first request or task, for what it then kept: the database
driver's import and a pooled connection, the object store's client and its HTTP connection, the broker's
connection, lazily built parts of its libraries. The first batch after a deployment started waited on all of
it, in every process on its way. Each step is best effort: a service that is down at start is reported by
the first request that needs it, as before, and the process still starts.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from functools import partial
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from celery import Celery

    from common.infra.db import Database
    from common.infra.storage import ObjectStore

log = logging.getLogger(__name__)


def _database(db: Database) -> None:
    # The connection goes back to the pool, open, for the first request to take.
    with db.engine.connect():
        pass


def _broker(celery: Celery) -> None:
    from common.broker.queue import direct_sender

    celery.backend  # noqa: B018  (made on first use, by the first send)
    sender = direct_sender(celery)
    if sender is not None:
        sender.ping()


def warm_up(databases: Sequence[Database], store: ObjectStore, celery: Celery | None = None) -> None:
    """Connect to the databases (a pooled connection each), the object store and (with `celery`) the broker
    now, keeping the connections."""
    steps: list[tuple[str, Callable[[], object]]] = [("database", partial(_database, db)) for db in databases]
    steps.append(("object store", store.check))
    if celery is not None:
        steps.append(("broker", lambda: _broker(celery)))
    for name, step in steps:
        try:
            step()
        except Exception as exc:
            log.warning("could not reach the %s at start (%s: %s); the first request that needs it will retry",
                        name, type(exc).__name__, exc)
