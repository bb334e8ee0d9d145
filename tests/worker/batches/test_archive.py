"""worker.batches.archive on hostile zips and tars, built here byte by byte, read from a local object folder."""

from __future__ import annotations

import bz2
import gzip
import io
import lzma
import stat
import struct
import tarfile
import tracemalloc
import uuid
import zipfile
import zlib
from pathlib import Path
from types import SimpleNamespace

import pytest

from common.infra.storage import LocalObjectStore
from worker.batches.archive import ArchiveError, ArchiveLimits, Member, members, normalize_path

PNG = b"\x89PNG\r\n\x1a\n" + b"not really, but bytes are bytes here" * 3
LIMITS = ArchiveLimits(member_bytes=20 * 1024 * 1024, entries=1000, total_bytes=200 * 1024 * 1024, ratio=100)


def read(tmp_path: Path, data: bytes, limits: ArchiveLimits = LIMITS) -> dict[str, bytes | str]:
    store = LocalObjectStore(tmp_path / "objects")
    key = f"files/{uuid.uuid4().hex}"
    store.put(key, data)
    record = SimpleNamespace(object_key=key, size_bytes=len(data))
    found: list[Member] = list(members(store, record, limits))  # type: ignore[arg-type]
    return dict(found)


def zip_of(entries: list[tuple[zipfile.ZipInfo | str, bytes]], method: int = zipfile.ZIP_DEFLATED) -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", method) as zf:
        for info, data in entries:
            zf.writestr(info, data)
    return buf.getvalue()


def tar_of(entries: list[tarfile.TarInfo | tuple[str, bytes]], mode: str = "w") -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode=mode, format=tarfile.PAX_FORMAT) as tf:  # type: ignore[call-overload]
        for entry in entries:
            if isinstance(entry, tarfile.TarInfo):
                tf.addfile(entry)
            else:
                info = tarfile.TarInfo(entry[0])
                info.size = len(entry[1])
                tf.addfile(info, io.BytesIO(entry[1]))
    return buf.getvalue()


def special(name: str, kind: bytes, linkname: str = "") -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type, info.linkname = kind, linkname
    return info


def escape_targets() -> tuple[str, str]:
    tag = uuid.uuid4().hex
    return f"../../../../../../tmp/vlmq-escape-{tag}.png", f"/tmp/vlmq-absolute-{tag}.png"


# --- names, links, device files ---------------------------------------------------------------------------

def test_zip_names_that_escape_are_refused_and_nothing_is_written(tmp_path: Path) -> None:
    climb, absolute = escape_targets()
    link = zipfile.ZipInfo("link.png")
    link.external_attr = (stat.S_IFLNK | 0o777) << 16
    got = read(tmp_path, zip_of([(climb, PNG), (absolute, PNG), ("C:/windows.png", PNG), ("a/../../b.png", PNG),
                                 (link, b"/etc/passwd"), ("ok/fine.png", PNG), ("ok/", b"")]))
    assert got[climb.replace("\\", "/")] == "climbs out of the archive ('..'); refused"
    assert got[absolute.lstrip("/")] == "is an absolute path; refused"
    assert got["C:/windows.png"] == "is an absolute path; refused"
    assert got["a/../../b.png"] == "climbs out of the archive ('..'); refused"
    assert got["link.png"] == "is a symbolic link; links are not followed"
    assert got["ok/fine.png"] == PNG and len(got) == 6
    assert not Path(absolute).exists() and not (tmp_path / climb).resolve().exists()
    assert not Path("/tmp", Path(climb).name).exists()


def test_tar_links_devices_and_escaping_names_are_refused(tmp_path: Path) -> None:
    climb, absolute = escape_targets()
    got = read(tmp_path, tar_of([
        (climb, PNG), (absolute, PNG), ("ok.png", PNG),
        special("sym.png", tarfile.SYMTYPE, "/etc/passwd"), special("hard.png", tarfile.LNKTYPE, "ok.png"),
        special("dev.png", tarfile.CHRTYPE), special("disk.png", tarfile.BLKTYPE),
        special("pipe.png", tarfile.FIFOTYPE),
        special("dir", tarfile.DIRTYPE),
    ], mode="w:gz"))
    assert got == {
        climb: "climbs out of the archive ('..'); refused", absolute.lstrip("/"): "is an absolute path; refused",
        "ok.png": PNG, "sym.png": "is a symbolic link; links are not followed",
        "hard.png": "is a hard link; links are not followed", "dev.png": "is a device file",
        "disk.png": "is a device file", "pipe.png": "is a FIFO",
    }
    assert not Path(absolute).exists() and not Path("/tmp", Path(climb).name).exists()


def test_names_that_are_not_utf8(tmp_path: Path) -> None:
    info = tarfile.TarInfo("x")
    info.size = len(PNG)
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.GNU_FORMAT, encoding="latin-1") as tf:
        info.name = "caf\xe9.png"  # latin-1 bytes in the header, not UTF-8
        tf.addfile(info, io.BytesIO(PNG))
    assert read(tmp_path, buf.getvalue()) == {"caf\\xe9.png": "name is not UTF-8"}
    flagged = bytearray(zip_of([("cafe.png", PNG)]))
    for signature, flag_at, name_at in ((b"PK\x03\x04", 6, 30), (b"PK\x01\x02", 8, 46)):
        at = flagged.find(signature)
        flagged[at + flag_at + 1] |= 0x08  # general purpose bit 11: the name is UTF-8
        flagged[at + name_at + 3] = 0xFF  # ... and it is not
    with pytest.raises(ArchiveError, match="not a readable zip archive"):
        read(tmp_path, bytes(flagged))


def test_normalize_path_keeps_one_spelling() -> None:
    assert normalize_path("./a\\b//c.png") == "a/b/c.png"
    assert normalize_path("a/../../etc/passwd") is None


# --- bombs -------------------------------------------------------------------------------------------------

def test_zip_member_ratio_and_methods(tmp_path: Path) -> None:
    zeros = b"\0" * (10 * 1024 * 1024)
    got = read(tmp_path, zip_of([("bomb.bmp", zeros), ("ok.png", PNG)]))
    assert "more than 100:1 (archive_max_ratio); possible zip bomb" in str(got["bomb.bmp"]) and got["ok.png"] == PNG
    small_zeros = read(tmp_path, zip_of([("blank.bmp", b"\0" * 1_000_000)]))  # under the floor: a blank image
    assert small_zeros["blank.bmp"] == b"\0" * 1_000_000
    assert read(tmp_path, zip_of([("b.png", PNG)], zipfile.ZIP_BZIP2)) == {
        "b.png": "uses zip compression method 12; only stored and deflate are read"}
    big = read(tmp_path, zip_of([("big.png", PNG * 10)]), ArchiveLimits(len(PNG) * 5, 10, 10**9, 100))
    assert big == {"big.png": f"is {len(PNG) * 10} bytes; the limit for an image is {len(PNG) * 5}"}


def _lie_about_size(data: bytes, size: int) -> bytes:
    patched = bytearray(data)
    for signature, size_at in ((b"PK\x03\x04", 22), (b"PK\x01\x02", 24)):
        at = patched.find(signature)
        patched[at + size_at:at + size_at + 4] = struct.pack("<I", size)
    return bytes(patched)


def test_zip_member_lying_about_its_size_never_expands(tmp_path: Path) -> None:
    liar = _lie_about_size(zip_of([("liar.png", b"\0" * (60 * 1024 * 1024))]), 5000)
    tracemalloc.start()
    try:
        got = read(tmp_path, liar)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert str(got["liar.png"]).startswith("cannot be read from the archive")  # its CRC no longer matches
    assert peak < 8 * 1024 * 1024, peak  # zipfile's own read() would have inflated all 60 MB at once


def test_entry_count_cap(tmp_path: Path) -> None:
    many: list[tuple[zipfile.ZipInfo | str, bytes]] = [(f"{i}.png", PNG) for i in range(30)]
    limits = ArchiveLimits(10**6, 10, 10**9, 100)
    with pytest.raises(ArchiveError, match=r"more than 10 entries \(archive_max_entries\)"):
        read(tmp_path, zip_of(many), limits)
    with pytest.raises(ArchiveError, match=r"more than 10 entries"):
        read(tmp_path, tar_of(many, mode="w:gz"), limits)  # type: ignore[arg-type]
    assert len(read(tmp_path, zip_of(many[:10]), limits)) == 10
    # A directory claiming fewer entries than it holds is counted, not believed.
    lying = bytearray(zip_of(many))
    end = lying.rfind(b"PK\x05\x06")
    lying[end + 8:end + 12] = struct.pack("<HH", 3, 3)
    with pytest.raises(ArchiveError, match=r"more than 10 entries"):
        read(tmp_path, bytes(lying), limits)


def test_total_uncompressed_cap(tmp_path: Path) -> None:
    parts = [(f"{i}.png", bytes([i]) * 8000) for i in range(10)]
    limits = ArchiveLimits(10**6, 100, 50_000, 10**6)
    for archive in (zip_of(parts), tar_of(parts), tar_of(parts, "w:gz")):  # type: ignore[arg-type]
        with pytest.raises(ArchiveError, match=r"more than 50000 bytes \(archive_max_total_bytes\)"):
            read(tmp_path, archive, limits)


def test_compressed_tar_bomb_refused_while_inflating(tmp_path: Path) -> None:
    huge = tarfile.TarInfo("huge.bmp")
    huge.size = 200 * 1024 * 1024
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w") as tf:
        tf.addfile(huge, io.BytesIO(bytes(huge.size)))
    bomb = gzip.compress(raw.getvalue(), 9)
    assert len(bomb) < 300_000
    tracemalloc.start()
    try:
        with pytest.raises(ArchiveError, match=r"expands more than 100:1 \(archive_max_ratio\)"):
            read(tmp_path, bomb, ArchiveLimits(20 * 1024 * 1024, 1000, 10**12, 100))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 32 * 1024 * 1024, peak


def test_pax_header_bomb_is_bounded(tmp_path: Path) -> None:
    # A pax extended header, which tarfile reads into memory whole: 30 MB of one attribute (any size works).
    value = b"a" * (30 * 1024 * 1024)
    record = b" path=" + value + b"\n"
    length = len(record) + len(str(len(record) + 10))
    body = str(length).encode() + record
    header = tarfile.TarInfo("././@PaxHeader")
    header.type, header.size = tarfile.XHDTYPE, len(body)
    raw = io.BytesIO()
    raw.write(header.tobuf(tarfile.USTAR_FORMAT))
    raw.write(body + bytes(-len(body) % 512))
    for compress in (lambda d: gzip.compress(d, 6), lambda d: bz2.compress(d, 9), lzma.compress):
        with pytest.raises(ArchiveError, match="archive_max_ratio"):
            read(tmp_path, compress(raw.getvalue()), ArchiveLimits(10**6, 10, 10**12, 100))


def test_compressed_tars_of_every_kind_are_read(tmp_path: Path) -> None:
    plain = tar_of([("a.png", PNG), ("b/c.png", PNG + b"!")])
    expected = {"a.png": PNG, "b/c.png": PNG + b"!"}
    # pigz and `cat a.gz b.gz` write several gzip members; some tools pad the end with zeros.
    half = len(plain) // 2
    multi = gzip.compress(plain[:half]) + gzip.compress(plain[half:]) + bytes(512)
    for data in (plain, gzip.compress(plain), bz2.compress(plain), lzma.compress(plain), multi):
        assert read(tmp_path, data) == expected
    with pytest.raises(ArchiveError, match="neither a zip nor a readable tar"):
        read(tmp_path, gzip.compress(plain)[:-200])
    with pytest.raises(ArchiveError, match="neither a zip nor a readable tar"):
        read(tmp_path, b"\x1f\x8b" + zlib.compress(plain))


def _without_utf8_flag(data: bytes) -> bytes:
    """The zip as Info-ZIP or macOS's Archive Utility write it: UTF-8 names, general purpose bit 11 unset."""
    patched = bytearray(data)
    for signature, flag_at in ((b"PK\x03\x04", 6), (b"PK\x01\x02", 8)):
        at = patched.find(signature)
        patched[at + flag_at + 1] &= ~0x08 & 0xFF
    return bytes(patched)


def test_zip_names_in_utf8_without_the_flag_and_in_cp437(tmp_path: Path) -> None:
    utf8 = zip_of([("café/日本.png", PNG)])
    assert read(tmp_path, _without_utf8_flag(utf8)) == {normalize_path("café/日本.png"): PNG}
    cp437 = bytearray(_without_utf8_flag(zip_of([("caf\u00e9.png", PNG)])))
    for signature, name_at in ((b"PK\x03\x04", 30), (b"PK\x01\x02", 46)):
        at = cp437.find(signature) + name_at
        # DOS-era tools: 0x82 is cp437's e-acute, one byte (not UTF-8) where UTF-8 took two; zipfile ends a
        # name at its first NUL, which pads it to the same length.
        cp437[at:at + 9] = b"caf\x82.png\x00"
    assert list(read(tmp_path, bytes(cp437))) == [normalize_path("caf\u00e9.png")]
