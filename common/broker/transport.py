"""Two repairs to kombu's Redis channel, so that a Celery process rides out a broker restart.

What went wrong (kombu 5.7, celery 5.7): when Redis goes away, Celery's consumer calls `connection.collect()`
and then `connection.close()`. collect() closes the task channel first, and that channel still had a BRPOP in
flight: its close() reads the BRPOP's reply before anything else, the read fails on the dead socket, and the
connection error ends close() there, swallowed by kombu. The channel is left open, its unacked messages not
restored. collect() then detaches the transport from its connection (`transport.client = None`). close()
closes the same channel again; this time it gets as far as restoring the unacked messages, which builds a new
Redis pool from `transport.client.hostname`, and the AttributeError that raises is no connection error:
Celery logs "Unrecoverable error" and the worker stops (kombu issues #582 and #970 are the same fault by
other paths).

The repairs, both to `kombu.transport.redis.Channel` (SentinelChannel inherits them), for every scheme the
Redis transport serves (redis://, rediss://, sentinel://):

- close() treats a failed read of the in-flight BRPOP as "nothing left to read" and goes on closing: the
  unacked messages are restored right then (or, with Redis still down, left in Redis's unacked hash for
  `restore_visible` after the visibility timeout; the job leases and the sweep's republisher cover an empty
  restart), and the second close has nothing left to do.
- a channel whose transport was detached raises a redis ConnectionError when asked for a new pool, instead
  of an AttributeError: kombu and Celery treat that as the connection loss it is, whatever path gets there.
"""

from __future__ import annotations

import logging
from typing import Any

from kombu.transport import redis as kombu_redis
from redis.exceptions import ConnectionError as RedisConnectionError

log = logging.getLogger(__name__)

_PATCHED = "__vlmq_patched__"


def _close(original: Any) -> Any:
    def close(self: kombu_redis.Channel) -> None:
        if self._in_poll and not self.closed:
            try:
                self._brpop_read()  # clears _in_poll whatever happens; a reply that came is still delivered
            except kombu_redis.Empty:
                pass
            except self.connection_errors as exc:
                # The socket is dead (_brpop_read disconnected it): its reply will never come. Close the rest.
                log.debug("broker connection lost while closing a channel: %r", exc)
        original(self)

    return close


def _connparams(original: Any) -> Any:
    def connparams(self: kombu_redis.Channel, asynchronous: bool = False) -> dict[str, Any]:
        transport = self.connection
        if transport is None or transport.client is None:
            raise RedisConnectionError("the broker connection of this channel was closed")
        return original(self, asynchronous=asynchronous)  # type: ignore[no-any-return]

    return connparams


def install() -> None:
    """Patch kombu's Redis channel, once per process (make_celery calls it: every process that speaks to the
    broker through Celery makes its app there)."""
    channel = kombu_redis.Channel
    if getattr(channel, _PATCHED, False):
        return
    channel.close = _close(channel.close)  # type: ignore[method-assign]
    channel._connparams = _connparams(channel._connparams)  # type: ignore[method-assign]
    setattr(channel, _PATCHED, True)
