"""How many messages wait in each Celery queue on the Redis broker (for metrics and the status page).

kombu keeps a queue as one Redis list per priority step (`<queue>` and `<queue>\\x06\\x16<step>`); a queue's
depth is the sum of their lengths. Messages taken by a worker but not acked yet are in the `unacked` hash.
"""

from __future__ import annotations

import redis

from common.broker.messages import UNACKED_KEY
from common.broker.queue import INGEST_QUEUE

PRIORITY_SEP = b"\x06\x16"
QUEUE_PATTERNS = ("jobs.*", INGEST_QUEUE + "*")


def queue_depths(broker_url: str) -> dict[str, int]:
    """Queue name -> messages waiting, plus `unacked` (delivered, not yet acked). Empty for a non-Redis broker
    (the in-process one of embedded mode cannot be seen from here)."""
    if not broker_url.startswith(("redis://", "rediss://")):
        return {}
    client = redis.Redis.from_url(broker_url, socket_timeout=5, socket_connect_timeout=5)
    try:
        keys = {key for pattern in QUEUE_PATTERNS for key in client.scan_iter(match=pattern, count=1000)}
        depths: dict[str, int] = {}
        ordered = sorted(keys)
        with client.pipeline(transaction=False) as pipe:
            for key in ordered:
                pipe.type(key)
            types = pipe.execute()
        lists = [key for key, kind in zip(ordered, types, strict=True) if kind == b"list"]
        with client.pipeline(transaction=False) as pipe:
            for key in lists:
                pipe.llen(key)
            lengths = pipe.execute()
        for key, length in zip(lists, lengths, strict=True):
            name = key.split(PRIORITY_SEP, 1)[0].decode(errors="replace")
            depths[name] = depths.get(name, 0) + int(length)
        depths.setdefault(INGEST_QUEUE, 0)
        depths["unacked"] = int(client.hlen(UNACKED_KEY))
        return depths
    finally:
        client.close()
