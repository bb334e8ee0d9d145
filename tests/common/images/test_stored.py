"""Many images looked up and inserted at once (owned_images, insert_images), as owned_image and store_image do
one at a time: only the tenant's own are found, and rows there already are kept. Postgres from the test
services, plus SQLite."""

from __future__ import annotations

import hashlib
import uuid
from pathlib import Path

import pytest
from sqlalchemy import select

from common.domain.models import ImageOwner, ImageRecord
from common.images.decode import inspect_image
from common.images.pack import ImagePack
from common.images.stored import insert_images, owned_image, owned_images, place_image, store_image
from common.infra.db import Database, get_database
from common.infra.migrate import upgrade
from common.infra.settings import Settings
from common.infra.storage import ObjectStore, make_store
from tests.api.test_jobs_api import png_bytes
from tests.conftest import settings_from_env


@pytest.fixture(params=["postgres", "sqlite"])
def backend(request: pytest.FixtureRequest, service_env: dict[str, str], tmp_path: Path
            ) -> tuple[Settings, Database, ObjectStore]:
    overrides: dict[str, object] = {}
    if request.param == "sqlite":
        overrides["database_url"] = f"sqlite:///{tmp_path / 'vlmq.db'}"
        upgrade(str(overrides["database_url"]))
    settings = settings_from_env(service_env, **overrides)
    return settings, get_database(settings.database_url), make_store(settings)


def test_many_images_are_looked_up_and_inserted_in_one_go(backend: tuple[Settings, Database, ObjectStore]
                                                           ) -> None:
    settings, db, store = backend
    seed = uuid.uuid4().bytes  # images no other test stored
    mine, theirs, *new = [png_bytes((seed[0], seed[1], i), (3 + i, 2)) for i in range(5)]
    tenant = f"t-{seed.hex()[:8]}"
    with db.session() as session:
        kept = store_image(session, store, mine, settings, tenant)
        store_image(session, store, theirs, settings, "someone-else")
    ids = [hashlib.sha256(data).hexdigest() for data in (mine, theirs, *new)]
    with db.session() as session:
        assert owned_images(session, tenant, ids) == {kept.id: owned_image(session, tenant, kept.id)}
        assert owned_images(session, tenant, []) == {}
        pack = ImagePack(store, 1 << 20)
        rows = []
        for data in (mine, theirs, *new):  # `mine` as a request that raced another of the tenant's
            info = inspect_image(data, max_pixels=settings.max_image_pixels)
            rows.append(place_image(store, data, info.sha256, info, pack)[1])
        assert insert_images(session, rows, tenant) == set(ids[1:])
        assert insert_images(session, [], tenant) == set()
        pack.flush()
    with db.session() as session:
        found = owned_images(session, tenant, ids)
        assert set(found) == set(ids)
        assert found[kept.id] == kept  # the row there already, as it was
        # Another tenant's row is kept, with its location; this tenant owns it from now on.
        assert session.get(ImageRecord, ids[1]).pack_key is None  # type: ignore[union-attr]
        for image_id, row in zip(ids[2:], rows[2:], strict=True):
            stored = found[image_id]
            assert stored.pack is not None and (stored.pack.key, stored.pack.offset) == (row["pack_key"],
                                                                                       row["pack_offset"])
            assert (stored.width, stored.height, stored.size_bytes) == (row["width"], row["height"],
                                                                       row["size_bytes"])
        owners = session.scalars(select(ImageOwner.tenant).where(ImageOwner.image_id == ids[1]))
        assert sorted(owners) == sorted([tenant, "someone-else"])
