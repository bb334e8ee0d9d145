"""New images stored together in packs: where each lies, and what SQL and a stored request remember of it."""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest

from common.images.pack import PACK_PREFIX, ImagePack, PackedImage
from common.images.refs import ResolvedImage, resolve_image
from common.images.stored import owned_image, store_image
from common.infra.db import Database, get_database
from common.infra.settings import Settings
from common.infra.storage import LocalObjectStore, image_key
from tests.api.test_jobs_api import data_url, png_bytes
from tests.conftest import settings_from_env
from worker.jobs.image_reader import ImageReader, ImageRef


class CountingStore(LocalObjectStore):
    def __init__(self, root: Path) -> None:
        super().__init__(root)
        self.puts: list[str] = []

    def put(self, key: str, data: bytes, content_type: str = "application/octet-stream") -> None:
        self.puts.append(key)
        super().put(key, data, content_type)


@pytest.fixture
def store(tmp_path: Path) -> CountingStore:
    return CountingStore(tmp_path / "objects")


@pytest.fixture(scope="module")
def settings(service_env: dict[str, str]) -> Settings:
    return settings_from_env(service_env)


@pytest.fixture(scope="module")
def db(settings: Settings) -> Database:
    return get_database(settings.database_url)


def fresh_png() -> bytes:
    """An image no other test stored: content-addressed rows are shared by the whole test run."""
    seed = uuid.uuid4().bytes
    return png_bytes((seed[0], seed[1], seed[2]), (5 + seed[3] % 20, 5 + seed[4] % 20))


def test_a_pack_holds_its_images_back_to_back_and_rolls_over(store: CountingStore) -> None:
    pack = ImagePack(store, max_bytes=10)
    first, second = pack.add(b"aaaa"), pack.add(b"bbbbbb")
    assert first.key == second.key and first.key.startswith(PACK_PREFIX)
    assert (first.offset, first.size, second.offset, second.size) == (0, 4, 4, 6)
    assert store.puts == []  # nothing is written before the flush
    third = pack.add(b"c")  # past max_bytes: the first pack is written, a new one begun
    assert store.puts == [first.key] and store.get(first.key) == b"aaaabbbbbb"
    assert third.key != first.key and third.offset == 0
    big = pack.add(b"x" * 25)  # larger than max_bytes: a pack of its own
    assert big.key != third.key and store.get(third.key) == b"c"
    pack.flush()
    pack.flush()  # nothing new: nothing written
    assert store.puts == [first.key, third.key, big.key]


def test_a_packed_image_is_remembered_where_it_lies(db: Database, settings: Settings,
                                                   store: CountingStore) -> None:
    data = fresh_png()
    pack = ImagePack(store, settings.image_pack_bytes)
    with db.session() as session:
        stored = store_image(session, store, data, settings, "acme", pack)
        assert stored.pack is not None and store.puts == []  # no object of its own
        pack.flush()
    with db.session() as session:
        again = owned_image(session, "acme", stored.id)
    assert again is not None and again.pack == stored.pack
    assert ImageReader(store).read(ImageRef(stored.id, again.pack)) == data
    assert ResolvedImage.of(again).as_part() == {"type": "image", "image_id": stored.id, **stored.pack.as_part_fields()}


def test_another_tenants_copy_names_its_own_pack(db: Database, settings: Settings, store: CountingStore) -> None:
    data = fresh_png()
    with db.session() as session:  # stored first as an object of its own
        lone = store_image(session, store, data, settings, "first")
    assert lone.pack is None and store.puts == [image_key(lone.id)]
    pack = ImagePack(store, settings.image_pack_bytes)
    with db.session() as session:
        resolved = resolve_image(data_url(data), session, store, settings, "second", pack)
        pack.flush()
    # The same bytes went the whole way into the second tenant's pack, and its requests name that copy, while
    # the shared row keeps naming the first.
    assert resolved.pack is not None and resolved.pack.key == pack_key(store)
    assert ImageReader(store).read(ImageRef(resolved.sha256, resolved.pack)) == data
    with db.session() as session:
        first, second = owned_image(session, "first", lone.id), owned_image(session, "second", lone.id)
    assert first is not None and first.pack is None
    assert second is not None and second.pack is None


def pack_key(store: CountingStore) -> str:
    keys = [key for key in store.puts if key.startswith(PACK_PREFIX)]
    assert len(keys) == 1
    return keys[0]


def test_a_part_names_its_pack_only_when_packed() -> None:
    packed = PackedImage("packs/p", 7, 9)
    assert PackedImage.of_part({"type": "image", "image_id": "x", **packed.as_part_fields()}) == packed
    assert PackedImage.of_part({"type": "image", "image_id": "x"}) is None


def test_a_pack_size_of_zero_stores_each_image_alone(store: CountingStore, settings: Settings) -> None:
    assert ImagePack.for_settings(store, settings.model_copy(update={"image_pack_bytes": 0})) is None
    pack = ImagePack.for_settings(store, settings)
    assert pack is not None and pack.max_bytes == settings.image_pack_bytes
