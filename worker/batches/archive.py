"""The members of an untrusted zip or tar archive, read without trusting it. No Celery, no filesystem writes.

Nothing is extracted to disk: members are read into memory one at a time and handed over as bytes, so '..' or
absolute names, links and device files can neither write nor read anything outside the archive. They are
still refused by name (a per-member error), so a manifest line naming one learns why.

Archive bombs are capped, each before the bytes it guards are produced: the number of entries (counted from
the zip central directory before zipfile parses it into objects), every member by size and by compression
ratio (a zip member from its header, before it is inflated), a compressed tar stream by ratio as it is
inflated, and the uncompressed total. Zip members are inflated in bounded pieces, so a member that lies about
its size cannot expand in memory; only stored and deflated members are read, because zipfile inflates
bzip2/lzma members without an output bound.
"""

from __future__ import annotations

import bz2
import io
import lzma
import re
import stat
import struct
import tarfile
import unicodedata
import zipfile
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from common.domain.files import open_reader, open_seekable
from common.infra.storage import ObjectStore

if TYPE_CHECKING:
    from common.domain.models import FileRecord
    from common.infra.settings import Settings

Member = tuple[str, bytes | str]  # (path, bytes or why the member is unusable)

# What zipfile, tarfile and the decompressors raise for damaged input (a zip name flagged UTF-8 that is not
# raises UnicodeDecodeError; truncated headers struct.error).
ARCHIVE_ERRORS = (zipfile.BadZipFile, tarfile.TarError, RuntimeError, NotImplementedError, OSError, EOFError,
                  zlib.error, lzma.LZMAError, UnicodeDecodeError, struct.error)
# Below this a member or stream is too small to be a bomb, whatever its ratio (a blank 1 MB BMP deflates 1000:1).
RATIO_FLOOR_BYTES = 8 * 1024 * 1024
MAX_PATH_CHARS = 4096
_READ_BYTES = 1024 * 1024
_JUNK_NAMES = (".DS_Store", "Thumbs.db", "desktop.ini")
_ABSOLUTE = re.compile(r"^(?:[/\\]|[A-Za-z]:)")
_SURROGATE = re.compile("[\udc80-\udcff]")
_EOCD, _EOCD64, _EOCD64_LOCATOR, _CENTRAL = b"PK\x05\x06", b"PK\x06\x06", b"PK\x06\x07", b"PK\x01\x02"


class ArchiveError(ValueError):
    """The archive as a whole is unusable or over a cap; the message says which."""


@dataclass(frozen=True)
class ArchiveLimits:
    member_bytes: int
    entries: int
    total_bytes: int
    ratio: float

    @classmethod
    def of(cls, settings: Settings) -> ArchiveLimits:
        return cls(settings.max_image_bytes, settings.archive_max_entries, settings.archive_max_total_bytes,
                   settings.archive_max_ratio)


def normalize_path(name: str) -> str | None:
    """One spelling per path: '/' separators, no './' or leading '/', NFC (macOS zips store NFD names);
    None for a path that climbs out ('..')."""
    parts = [p for p in unicodedata.normalize("NFC", name.replace("\\", "/")).split("/") if p not in ("", ".")]
    return "/".join(parts) if parts and ".." not in parts else None


def member_path(name: str) -> tuple[str, str | None]:
    """(the path a member is known by, why its name is refused or None)."""
    if _SURROGATE.search(name):  # tarfile decodes names with surrogateescape
        return name.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace"), "name is not UTF-8"
    if len(name) > MAX_PATH_CHARS:
        return name[:MAX_PATH_CHARS], f"name is longer than {MAX_PATH_CHARS} characters"
    path = normalize_path(name)
    if path is None:
        return name.replace("\\", "/"), "climbs out of the archive ('..'); refused"
    if _ABSOLUTE.match(name):
        return path, "is an absolute path; refused"
    return path, None


def junk(path: str) -> bool:
    base = path.rsplit("/", 1)[-1]
    return path.startswith("__MACOSX/") or base.startswith("._") or base in _JUNK_NAMES


def members(store: ObjectStore, record: FileRecord, limits: ArchiveLimits) -> Iterator[Member]:
    """(path, bytes or error) for each file of a zip or a (gzip/bzip2/xz-compressed) tar; ArchiveError when
    the archive is unreadable or over a cap."""
    with open_seekable(store, record.object_key, record.size_bytes) as handle:
        if handle.read(2) == b"PK":
            yield from _zip_members(handle, limits)
            return
    # A tar is read as a stream: no seeking, no local copy.
    stream = io.BufferedReader(_Inflating(open_reader(store, record.object_key), limits), _READ_BYTES)
    try:
        yield from _tar_members(stream, limits)
    except ARCHIVE_ERRORS as exc:
        raise ArchiveError(f"the images file is neither a zip nor a readable tar archive: {exc}") from None


def _size_problem(size: int, limits: ArchiveLimits) -> str | None:
    return f"is {size} bytes; the limit for an image is {limits.member_bytes}" if size > limits.member_bytes else None


def _over_total(limits: ArchiveLimits) -> ArchiveError:
    return ArchiveError(f"the images archive expands to more than {limits.total_bytes} bytes "
                        "(archive_max_total_bytes)")


def _zip_name(info: zipfile.ZipInfo) -> str:
    """The member's name as its creator wrote it. Without the UTF-8 flag (bit 11) zipfile reads names as
    cp437, but Info-ZIP and macOS's Archive Utility write UTF-8 there without setting it: a name whose cp437
    reading re-encodes to valid UTF-8 is taken as UTF-8 (ASCII names are the same either way)."""
    if info.flag_bits & 0x800:
        return info.filename
    try:
        return info.filename.encode("cp437").decode("utf-8")
    except UnicodeError:
        return info.filename


def _zip_members(handle: io.BufferedReader, limits: ArchiveLimits) -> Iterator[Member]:
    entries = _zip_entry_count(handle, limits.entries)
    if entries is not None and entries > limits.entries:
        raise ArchiveError(f"the images archive has more than {limits.entries} entries (archive_max_entries)")
    handle.seek(0)
    try:
        archive = zipfile.ZipFile(handle)
    except ARCHIVE_ERRORS as exc:
        raise ArchiveError(f"the images file is not a readable zip archive: {exc}") from None
    total = 0
    with archive:
        if len(archive.infolist()) > limits.entries:
            raise ArchiveError(f"the images archive has more than {limits.entries} entries (archive_max_entries)")
        for info in archive.infolist():
            if info.is_dir():
                continue
            path, problem = member_path(_zip_name(info))
            if junk(path):
                continue
            kind = stat.S_IFMT(info.external_attr >> 16)
            if problem is None and kind == stat.S_IFLNK:
                problem = "is a symbolic link; links are not followed"
            elif problem is None and kind not in (0, stat.S_IFREG):
                problem = "is not a regular file"
            elif problem is None and info.compress_type not in (zipfile.ZIP_STORED, zipfile.ZIP_DEFLATED):
                problem = f"uses zip compression method {info.compress_type}; only stored and deflate are read"
            problem = problem or _size_problem(info.file_size, limits)
            if problem is None and info.file_size > max(RATIO_FLOOR_BYTES, limits.ratio * info.compress_size):
                problem = (f"expands {info.file_size} bytes from {info.compress_size}, more than "
                           f"{limits.ratio:g}:1 (archive_max_ratio); possible zip bomb")
            if problem is not None:
                yield path, problem
                continue
            if total + info.file_size > limits.total_bytes:
                raise _over_total(limits)
            try:
                data = _read_zip_member(archive, info, limits.member_bytes)
            except ARCHIVE_ERRORS as exc:
                yield path, f"cannot be read from the archive: {exc}"
                continue
            total += len(data)
            yield path, data


def _read_zip_member(archive: zipfile.ZipFile, info: zipfile.ZipInfo, max_bytes: int) -> bytes:
    # read() with no size inflates with a 2 GB output bound; bounded reads keep a lying header harmless.
    data = bytearray()
    with archive.open(info) as member:
        while piece := member.read(_READ_BYTES):
            data += piece
            if len(data) > max_bytes:
                raise OSError(f"it is larger than its header says and than the limit of {max_bytes} bytes")
    return bytes(data)


def _zip_entry_count(handle: io.BufferedReader, limit: int) -> int | None:
    """Central directory records, counted up to limit + 1 without building objects; None when there is no
    directory to count (zipfile then reports the archive as unreadable)."""
    handle.seek(0, io.SEEK_END)
    end = handle.tell()
    tail_start = max(0, end - (22 + 0xFFFF))  # the end record sits before a comment of at most 64 KiB
    handle.seek(tail_start)
    tail = handle.read()
    at = tail.rfind(_EOCD)
    if at < 0 or len(tail) - at < 22:
        return None
    (size,) = struct.unpack("<I", tail[at + 12:at + 16])
    record = tail_start + at
    if at >= 20 and tail[at - 20:at - 16] == _EOCD64_LOCATOR:
        handle.seek(record - 20 - 56)
        zip64 = handle.read(56)
        if zip64[:4] == _EOCD64:
            (size,), record = struct.unpack("<Q", zip64[40:48]), record - 20 - 56
    # Where zipfile itself looks: just before the end record, whatever offset the record claims.
    start = record - size
    if start < 0:
        return None
    handle.seek(start)
    count = consumed = 0
    while consumed + 46 <= size and count <= limit:
        header = handle.read(46)
        if len(header) < 46 or header[:4] != _CENTRAL:
            break
        name, extra, comment = struct.unpack("<HHH", header[28:34])
        handle.read(name + extra + comment)
        consumed += 46 + name + extra + comment
        count += 1
    return count


def _tar_members(stream: io.BufferedIOBase, limits: ArchiveLimits) -> Iterator[Member]:
    count = 0
    with tarfile.open(fileobj=stream, mode="r|") as archive:
        for member in archive:
            count += 1
            if count > limits.entries:
                raise ArchiveError(f"the images archive has more than {limits.entries} entries (archive_max_entries)")
            # Checked before the loop moves on: tarfile would read through (inflate) this member to skip it.
            if member.offset_data + member.size > limits.total_bytes:
                raise _over_total(limits)
            if member.isdir():
                continue
            path, problem = member_path(member.name)
            if junk(path):
                continue
            problem = problem or _tar_kind_problem(member) or _size_problem(member.size, limits)
            if problem is not None:
                yield path, problem
                continue
            extracted = archive.extractfile(member)
            yield path, extracted.read() if extracted is not None else "cannot be read from the archive"


def _tar_kind_problem(member: tarfile.TarInfo) -> str | None:
    if member.issym():
        return "is a symbolic link; links are not followed"
    if member.islnk():
        return "is a hard link; links are not followed"
    if member.ischr() or member.isblk():
        return "is a device file"
    if member.isfifo():
        return "is a FIFO"
    return None if member.isfile() else "is not a regular file"


class _Inflating(io.RawIOBase):
    """The uncompressed bytes of a gzip, bzip2, xz or plain stream of pieces, inflated in bounded steps and
    refused once past the total cap or the ratio cap (which also bounds what tarfile buffers for a header)."""

    def __init__(self, chunks: Iterator[bytes], limits: ArchiveLimits) -> None:
        self.chunks, self.limits = chunks, limits
        self.pending = b""  # input not yet handed to the decompressor
        self.consumed = self.produced = 0
        while len(self.pending) < 6 and (piece := next(self.chunks, None)) is not None:
            self.pending += piece
        head = self.pending[:6]
        self.kind = ("gzip" if head[:2] == b"\x1f\x8b" else "bzip2" if head[:3] == b"BZh"
                     else "xz" if head == b"\xfd7zXZ\x00" else None)
        self.decompressor = self._new()

    def readable(self) -> bool:
        return True

    def _new(self) -> Any:  # zlib's decompressor type is not importable by name
        if self.kind == "gzip":
            return zlib.decompressobj(16 + zlib.MAX_WBITS)
        if self.kind == "bzip2":
            return bz2.BZ2Decompressor()
        return lzma.LZMADecompressor() if self.kind == "xz" else None

    def _input(self) -> bytes:
        data = self.pending or next(self.chunks, b"")
        self.pending = b""
        return data

    def readinto(self, buffer: memoryview) -> int:  # type: ignore[override]
        want = len(buffer)
        out = b""
        while not out:
            step = self._step(want)
            if step is None:
                return 0
            out = step
        buffer[:len(out)] = out
        self.produced += len(out)
        if self.produced > self.limits.total_bytes:
            raise _over_total(self.limits)
        if self.kind and self.produced > max(RATIO_FLOOR_BYTES, self.limits.ratio * self.consumed):
            raise ArchiveError(f"the compressed images archive expands more than {self.limits.ratio:g}:1 "
                               "(archive_max_ratio); possible archive bomb")
        return len(out)

    def _step(self, want: int) -> bytes | None:
        """Some output (maybe empty), or None at the end of the stream."""
        d = self.decompressor
        if d is None:
            data = self._input()
            self.consumed += len(data)
            out, self.pending = data[:want], data[want:]
            return out or None
        if d.eof:
            # Concatenated members (pigz, `cat a.gz b.gz`) continue the stream; anything else after the
            # end (padding) is ignored, as gzip itself does.
            self.pending = d.unused_data + self.pending
            nxt = self.pending or next(self.chunks, b"")
            if not nxt.startswith({"gzip": b"\x1f\x8b", "bzip2": b"BZh", "xz": b"\xfd7zXZ"}[self.kind or ""]):
                return None
            self.pending, self.decompressor = nxt, self._new()
            return b""
        if self.kind == "gzip":
            data = self._input()
            if not data:
                return None  # truncated: tarfile reports it
            chunk: bytes = d.decompress(data, want)
            self.pending = d.unconsumed_tail
            self.consumed += len(data) - len(d.unconsumed_tail)
            return chunk
        data = self._input() if d.needs_input else b""
        if d.needs_input and not data:
            return None
        self.consumed += len(data)
        inflated: bytes = d.decompress(data, want)
        return inflated
