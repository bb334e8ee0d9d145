"""A job's images read back: lone ones by key, packed ones by range, a chunk's packed ones with one request per
stretch of a pack, and bytes that do not hash to the image's id refused."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from common.images.pack import ImagePack, PackedImage
from common.infra.storage import LocalObjectStore, ObjectNotFound, image_key
from worker.jobs import image_reader
from worker.jobs.image_reader import ImageReader, ImageRef, image_refs


class RangeCountingStore(LocalObjectStore):
    def __init__(self, root: Path) -> None:
        super().__init__(root)
        self.ranges: list[tuple[str, int, int]] = []

    def get_range(self, key: str, start: int, size: int) -> bytes:
        self.ranges.append((key, start, size))
        return super().get_range(key, start, size)


@pytest.fixture
def store(tmp_path: Path) -> RangeCountingStore:
    return RangeCountingStore(tmp_path / "objects")


def ref_of(data: bytes, packed: PackedImage | None) -> ImageRef:
    return ImageRef(hashlib.sha256(data).hexdigest(), packed)


def test_lone_and_packed_images_read_back(store: RangeCountingStore) -> None:
    lone, packed_bytes = b"lone image", b"packed image"
    store.put(image_key(ref_of(lone, None).sha256), lone)
    pack = ImagePack(store, 1 << 20)
    pack.add(b"something before")
    at = pack.add(packed_bytes)
    pack.flush()
    reader = ImageReader(store)
    assert reader.read(ref_of(lone, None)) == lone
    assert reader.read(ref_of(packed_bytes, at)) == packed_bytes
    with pytest.raises(ObjectNotFound):  # the wrong bytes for this id: never handed on
        reader.read(ImageRef(ref_of(packed_bytes, at).sha256, PackedImage(at.key, 0, at.size)))
    with pytest.raises(ObjectNotFound):
        reader.read(ref_of(b"never stored", None))


def test_a_chunks_packed_images_take_one_request_per_stretch(store: RangeCountingStore,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(image_reader, "MERGE_GAP_BYTES", 100)
    pack = ImagePack(store, 1 << 20)
    images = [bytes([i]) * (10 + i) for i in range(6)]
    places = [pack.add(data) for data in images]
    gap = pack.add(b"\x00" * 500)  # wanted by nobody: splits the pack into two stretches
    late = [bytes([50 + i]) * 20 for i in range(2)]
    places += [pack.add(data) for data in late]
    pack.flush()
    other = ImagePack(store, 1 << 20)
    elsewhere = other.add(b"in another pack")
    other.flush()
    wanted = [ref_of(data, at) for data, at in zip(images + late, places, strict=True)]
    wanted += [wanted[0], ref_of(b"in another pack", elsewhere), ref_of(b"lone", None)]
    found = ImageReader(store).read_many(wanted)
    assert found == {ref: data for ref, data in zip(wanted[:8], images + late, strict=True)} | {
        wanted[9]: b"in another pack"}  # a lone image is left to read()
    assert sorted(store.ranges) == sorted([
        (places[0].key, 0, places[5].offset + places[5].size),
        (places[0].key, gap.offset + gap.size, 40),
        (elsewhere.key, 0, len(b"in another pack")),
    ])


def test_image_refs_follow_the_request_order() -> None:
    request = {"messages": [
        {"role": "user", "content": [{"type": "image", "image_id": "a", "pack": "packs/p", "offset": 3, "size": 4},
                                     {"type": "text", "text": "and"}, {"type": "image", "image_id": "b"}]},
    ]}
    assert image_refs(request) == [ImageRef("a", PackedImage("packs/p", 3, 4)), ImageRef("b", None)]


class WholeObjectStore(LocalObjectStore):
    """A server that ignores Range and sends the whole object."""

    def get_range(self, key: str, start: int, size: int) -> bytes:
        return self.get(key)


class ShortReadStore(LocalObjectStore):
    def get_range(self, key: str, start: int, size: int) -> bytes:
        return super().get_range(key, start, size)[:-1]


def test_a_range_the_server_ignored_or_cut_short(tmp_path: Path) -> None:
    whole, short = WholeObjectStore(tmp_path / "a"), ShortReadStore(tmp_path / "b")
    refs = []
    for store in (whole, short):
        pack = ImagePack(store, 1 << 20)
        pack.add(b"first image")
        refs.append(ref_of(b"second image", pack.add(b"second image")))
        pack.flush()
    assert ImageReader(whole).read(refs[0]) == b"second image"
    assert ImageReader(whole).read_many([refs[0]]) == {refs[0]: b"second image"}
    with pytest.raises(OSError, match="read 11 of the 12 bytes"):  # retried as a fault, not a missing image
        ImageReader(short).read(refs[1])
