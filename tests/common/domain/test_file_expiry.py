"""common/domain/file_expiry.py: expired files deleted, rows and objects, but never under a batch still
ingesting them."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path

from common.domain import batches
from common.domain.file_expiry import ExpiresAfter, delete_expired_files
from common.domain.files import add_file, file_key
from common.domain.models import Batch, BatchStatus, FileRecord, new_file_id, utcnow
from common.infra.db import get_database
from common.infra.migrate import upgrade
from common.infra.settings import Settings
from common.infra.storage import make_store


def test_expired_files_go_unless_a_batch_is_still_ingesting_them(tmp_path: Path) -> None:
    settings = Settings(data_dir=tmp_path)
    upgrade(settings.database_url)
    db, store = get_database(settings.database_url), make_store(settings)
    hour = ExpiresAfter(anchor="created_at", seconds=3600)
    ids = {name: new_file_id() for name in ("expired", "ingesting", "later", "never")}
    with db.session() as session:
        for name, file_id in ids.items():
            store.put(file_key(file_id, "acme"), b"{}\n")
            add_file(session, file_id=file_id, key=file_key(file_id, "acme"), size=3, filename=f"{name}.jsonl",
                     purpose="batch", tenant="acme", expires_after=None if name == "never" else hour)
        for name in ("expired", "ingesting"):
            session.get(FileRecord, ids[name]).expires_at = utcnow() - timedelta(seconds=1)  # type: ignore[union-attr]
        batch_id = batches.create_batch(session, input_file_id=ids["ingesting"], endpoint="/v1/chat/completions",
                                        completion_window="24h", model="m", metadata=None, tenant="acme").id
    assert delete_expired_files(db, store) == 1
    with db.session() as session:
        left = {r.filename for r in session.query(FileRecord)}
    assert left == {"ingesting.jsonl", "later.jsonl", "never.jsonl"}
    assert not store.exists(file_key(ids["expired"], "acme")) and store.exists(file_key(ids["ingesting"], "acme"))
    with db.session() as session:  # once the batch has read it, it goes too
        assert batches.fail(session, batch_id, [])
        assert session.get(Batch, batch_id).status == BatchStatus.FAILED  # type: ignore[union-attr]
    assert delete_expired_files(db, store) == 1
    assert not store.exists(file_key(ids["ingesting"], "acme"))
