"""A folder of images zipped for upload with a batch (`vlmq batch submit`, `vlmq run --images`)."""

from __future__ import annotations

import tempfile
import zipfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


@contextmanager
def images_archive(images: Path) -> Iterator[Path]:
    """An archive as is, or a folder zipped (stored, not deflated: images are compressed already)."""
    if images.is_file():
        yield images
        return
    root = images.resolve()
    with tempfile.TemporaryDirectory(prefix="vlmq-") as tmp:
        path = Path(tmp) / f"{images.name or 'images'}.zip"
        with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as zf:
            for file in sorted(p for p in images.rglob("*") if p.is_file()):
                # A link out of the folder (to /etc/passwd, say) is not uploaded: lines naming it are refused
                # as missing, as the server refuses link members of an archive.
                if file.resolve().is_relative_to(root):
                    zf.write(file, file.relative_to(images).as_posix())
        yield path
