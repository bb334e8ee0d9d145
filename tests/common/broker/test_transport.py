"""kombu's Redis channel closed after the broker died (common/broker/transport.py), against a redis-server of
the test's own that it kills and restarts."""

from __future__ import annotations

import contextlib
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from kombu import Connection, Consumer, Exchange, Message, Producer, Queue
from kombu.common import ignore_errors
from redis.exceptions import ConnectionError as RedisConnectionError

from common.broker.transport import install
from tests.fault_stack import RedisServer

JOBS = Queue("jobs", Exchange("jobs", type="direct"), routing_key="jobs")
# Like Celery's remote-control queue, which every worker consumes on a second channel of its connection.
BROADCAST = Queue("broadcast", Exchange("broadcast", type="fanout"), auto_delete=True)


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[RedisServer]:
    server = RedisServer(tmp_path / "redis", appendonly=True)  # the restart keeps the unacked message
    server.start()
    try:
        yield server
    finally:
        server.kill()


def _connection(server: RedisServer) -> Connection:
    return Connection(server.url, transport_options={"visibility_timeout": 1})


def _publish(server: RedisServer, body: dict[str, int]) -> None:
    with _connection(server) as conn:
        Producer(conn.default_channel).publish(body, exchange=JOBS.exchange, routing_key="jobs", declare=[JOBS])


def _drain_until(conn: Connection, received: list[Any], timeout: float = 10) -> None:
    """Drain until a message came (a subscription's confirmation is an event too)."""
    deadline = time.monotonic() + timeout
    while not received and time.monotonic() < deadline:
        with contextlib.suppress(socket.timeout):
            conn.drain_events(timeout=1)


def test_a_worker_connection_closed_after_redis_died_raises_no_attribute_error(
        redis_server: RedisServer) -> None:
    """Celery's consumer on a lost connection: `collect()`, then `close()` under ignore_errors. The second
    close met the task channel half closed by the first, with its transport detached, and kombu's
    AttributeError ('NoneType' object has no attribute 'hostname') stopped the worker."""
    install()
    _publish(redis_server, {"n": 1})
    conn = _connection(redis_server)
    received: list[Message] = []
    Consumer(conn.default_channel, [JOBS], callbacks=[lambda body, message: received.append(message)],
             accept=["json"]).consume()
    Consumer(conn.channel(), [BROADCAST], accept=["json"]).consume()
    _drain_until(conn, received)
    assert len(received) == 1  # held, not acked
    conn.default_channel._brpop_start()  # type: ignore[attr-defined]  # the event loop's next BRPOP, in flight when Redis goes

    redis_server.kill()
    conn.collect(socket_timeout=1)
    ignore_errors(conn, conn.close)  # raised the AttributeError

    # The message stayed in Redis's unacked set; after the visibility timeout it is delivered again.
    redis_server.start()
    time.sleep(1.2)
    again: list[dict[str, int]] = []
    with _connection(redis_server) as fresh:
        fresh.default_channel.qos.restore_visible()
        Consumer(fresh.default_channel, [JOBS], callbacks=[lambda body, message: again.append(body)],
                 accept=["json"], no_ack=True).consume()
        _drain_until(fresh, again)
    assert again == [{"n": 1}]


def test_a_detached_channel_asked_for_a_new_pool_raises_a_connection_error(redis_server: RedisServer) -> None:
    """Whatever path reaches a channel whose transport was detached, kombu and Celery must see a connection
    error (which they handle by reconnecting), not an AttributeError."""
    install()
    conn = _connection(redis_server)
    channel = conn.default_channel
    conn.collect()  # detaches the transport: transport.client is None
    with pytest.raises(RedisConnectionError):
        channel._connparams()  # type: ignore[attr-defined]
    assert issubclass(RedisConnectionError, conn.connection_errors)
