"""Upload an image once; jobs then refer to it by id."""

from __future__ import annotations

from fastapi import APIRouter, File, HTTPException, UploadFile

from api.auth import TenantDep
from api.deps import SessionDep, SettingsDep, StorageDep
from api.errors import error_responses
from common.domain.schemas import ImageView
from common.images.stored import IMAGE_ID_RE, StoredImage, image_public_id, owned_image, store_image

router = APIRouter(prefix="/v1/images", tags=["images"])


def image_view(record: StoredImage) -> ImageView:
    return ImageView(id=image_public_id(record.id), sha256=record.id, format=record.format, width=record.width,
                     height=record.height, bytes=record.size_bytes, created_at=record.created_at)


@router.post("", status_code=201, response_model=ImageView, responses=error_responses(400, 413))
async def upload_image(
    session: SessionDep, store: StorageDep, settings: SettingsDep, tenant: TenantDep, file: UploadFile = File(...)
) -> ImageView:
    data = await file.read(settings.max_image_bytes + 1)
    if not data:
        raise HTTPException(400, "the uploaded file is empty")
    return image_view(store_image(session, store, data, settings, tenant))


@router.get("/{image_id}", response_model=ImageView, responses=error_responses(404))
def get_image(image_id: str, session: SessionDep, tenant: TenantDep) -> ImageView:
    """The tenant's own images only: another tenant's is not found, as one never stored."""
    match = IMAGE_ID_RE.match(image_id)
    record = owned_image(session, tenant, match.group(1)) if match else None
    if record is None:
        raise HTTPException(404, f"image {image_id!r} not found")
    return image_view(record)
