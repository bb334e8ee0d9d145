"""A request vlmq refuses, and the HTTP status and code the API answers it with."""

from __future__ import annotations


class SubmissionError(ValueError):
    """A request we refuse; `status_code` is the HTTP status the API answers with."""

    def __init__(self, message: str, status_code: int = 400, code: str = "invalid_request",
                 param: str | None = None) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.code = code
        self.param = param  # the request field at fault, when there is one
