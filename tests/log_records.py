"""A logging handler that keeps what it is given, for tests that assert what a server logged (or did not)."""

from __future__ import annotations

import logging


class LogRecords(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)

    def errors(self) -> list[str]:
        """The ERROR records and those that carry a traceback."""
        return [f"{r.name}: {r.getMessage()}" for r in self.records if r.levelno >= logging.ERROR or r.exc_info]
