"""Celery and the broker: the queues, kombu's message format, fast sends, dispatch and broker stats."""
