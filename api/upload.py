"""Streaming multipart upload: file parts go straight to object storage, never whole into memory.

Starlette's form parser spools files to a temporary file first; a 200 MB batch file would then be written
to local disk and read back. Here each file part's bytes flow from the request into an object writer (an S3
multipart upload) in pieces, with the size limit enforced while they flow.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from fastapi import Request
from fastapi.concurrency import run_in_threadpool
from python_multipart.exceptions import FormParserError
from python_multipart.multipart import MultipartParser, parse_options_header

from common.domain.files import ObjectWriter, open_writer
from common.domain.submission import SubmissionError
from common.infra.storage import ObjectStore

FLUSH_BYTES = 1024 * 1024  # hand a writer at least this much at a time (one thread hop per MiB)
MAX_FIELD_BYTES = 64 * 1024
MAX_FIELDS = 16


@dataclass
class UploadedFile:
    key: str
    filename: str
    size: int = 0


@dataclass
class Upload:
    fields: dict[str, str] = field(default_factory=dict)
    files: dict[str, UploadedFile] = field(default_factory=dict)


class _Receiver:
    """python-multipart callbacks: collect small fields, queue file bytes for the async side to write."""

    def __init__(self, file_keys: dict[str, str]) -> None:
        self.file_keys = file_keys
        self.upload = Upload()
        self.headers: dict[bytes, bytes] = {}
        self.header_name = b""
        self.header_value = b""
        self.part_name: str | None = None
        self.current_file: str | None = None
        self.field_data = bytearray()
        self.pending: dict[str, bytearray] = {}  # file field -> bytes received, not yet written
        self.error: SubmissionError | None = None

    def on_part_begin(self) -> None:
        self.headers, self.part_name, self.current_file = {}, None, None
        self.field_data.clear()

    def on_header_field(self, data: bytes, start: int, end: int) -> None:
        self.header_name += data[start:end]

    def on_header_value(self, data: bytes, start: int, end: int) -> None:
        self.header_value += data[start:end]

    def on_header_end(self) -> None:
        self.headers[self.header_name.lower()] = self.header_value
        self.header_name, self.header_value = b"", b""

    def on_headers_finished(self) -> None:
        _, options = parse_options_header(self.headers.get(b"content-disposition", b""))
        name = options.get(b"name")
        if name is None:
            self.refuse("every multipart part needs a name")
            return
        self.part_name = name.decode("utf-8", "replace")
        if b"filename" in options:
            if self.part_name not in self.file_keys or self.part_name in self.upload.files:
                self.refuse(f"send one file in each of the multipart fields {', '.join(map(repr, self.file_keys))}")
                return
            filename = _printable(options[b"filename"].decode("utf-8", "replace")) or self.part_name
            self.upload.files[self.part_name] = UploadedFile(self.file_keys[self.part_name], filename)
            self.pending[self.part_name] = bytearray()
            self.current_file = self.part_name
        elif len(self.upload.fields) >= MAX_FIELDS:
            self.refuse(f"at most {MAX_FIELDS} form fields are accepted")

    def on_part_data(self, data: bytes, start: int, end: int) -> None:
        if self.error is not None:
            return
        if self.current_file is not None:
            self.pending[self.current_file] += data[start:end]
            self.upload.files[self.current_file].size += end - start
        else:
            self.field_data += data[start:end]
            if len(self.field_data) > MAX_FIELD_BYTES:
                self.refuse(f"form field {self.part_name!r} is longer than {MAX_FIELD_BYTES} bytes")

    def on_part_end(self) -> None:
        if self.error is None and self.current_file is None and self.part_name is not None:
            self.upload.fields[self.part_name] = self.field_data.decode("utf-8", "replace")

    def refuse(self, message: str, status: int = 400) -> None:
        if self.error is None:
            self.error = SubmissionError(message, status, "invalid_request" if status == 400 else "file_too_large")


def _printable(name: str) -> str:
    """A client's file name without control characters: they cannot be stored (NUL) or sent back in a
    Content-Disposition header."""
    return "".join(c for c in name if c.isprintable())


async def receive_upload(request: Request, store: ObjectStore, file_keys: dict[str, str], max_bytes: int) -> Upload:
    """Parse a multipart body, streaming each file field named in `file_keys` to its object key (each at
    most `max_bytes`). The objects exist only if this returns: a refused or broken upload is aborted."""
    _, params = parse_options_header(request.headers.get("content-type", ""))
    boundary = params.get(b"boundary")
    if not boundary:
        raise SubmissionError("multipart/form-data body without a boundary")
    receiver = _Receiver(file_keys)
    try:
        parser = MultipartParser(boundary, {
            "on_part_begin": receiver.on_part_begin, "on_part_data": receiver.on_part_data,
            "on_part_end": receiver.on_part_end, "on_header_field": receiver.on_header_field,
            "on_header_value": receiver.on_header_value, "on_header_end": receiver.on_header_end,
            "on_headers_finished": receiver.on_headers_finished,
        })
    except (FormParserError, ValueError):  # a boundary over python-multipart's length limit, say
        raise SubmissionError("the multipart boundary is invalid (RFC 2046 allows 1-70 characters)") from None
    writers: dict[str, ObjectWriter] = {}

    async def flush(name: str, at_least: int) -> None:
        data = receiver.pending[name]
        if len(data) < at_least:
            return
        if name not in writers:
            writers[name] = await run_in_threadpool(open_writer, store, file_keys[name], "application/octet-stream")
        await run_in_threadpool(writers[name].write, bytes(data))
        data.clear()

    try:
        async for chunk in request.stream():
            if receiver.error is not None:
                continue  # drain the body so the client reads our answer instead of a reset connection
            try:
                parser.write(chunk)
            except FormParserError:
                receiver.refuse("the multipart body is malformed")
                continue
            if any(f.size > max_bytes for f in receiver.upload.files.values()):
                receiver.refuse(f"the file is larger than this server's limit of {max_bytes} bytes", 413)
                continue
            for name in receiver.pending:
                await flush(name, FLUSH_BYTES)
        if receiver.error is not None:
            raise receiver.error
        try:
            parser.finalize()
        except FormParserError:
            raise SubmissionError("the multipart body is malformed or truncated") from None
        for name in receiver.pending:
            await flush(name, 1 if name in writers else 0)  # every file gets an object, even an empty one
            await run_in_threadpool(writers[name].close)
    except BaseException:
        for writer in writers.values():
            await run_in_threadpool(writer.abort)
        raise
    return receiver.upload
