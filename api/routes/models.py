"""The served model, as OpenAI and vLLM list theirs: an API process serves one (VLMQ_SERVED_MODEL_NAME,
by default VLMQ_MODEL's folder name), the one every job it accepts runs on."""

from __future__ import annotations

import time

from fastapi import APIRouter
from fastapi.responses import JSONResponse

from api.deps import StateDep
from api.errors import error_body, error_responses
from common.domain.schemas import ModelList, ModelView
from common.infra.settings import Settings

router = APIRouter(prefix="/v1/models", tags=["models"])

OWNER = "vlmq"
# OpenAI gives a model's creation time; ours is when this process began serving it.
_SERVING_SINCE = int(time.time())


def _served(settings: Settings) -> list[ModelView]:
    name = settings.served_model_name
    return [ModelView(id=name, created=_SERVING_SINCE, owned_by=OWNER)] if name else []


@router.get("", response_model=ModelList)
async def list_models(state: StateDep) -> ModelList:
    return ModelList(data=_served(state.settings))


# `:path`: a served name may hold slashes (an HF id such as org/model), which the openai client sends as is.
@router.get("/{model_id:path}", response_model=ModelView, responses=error_responses(404))
async def get_model(model_id: str, state: StateDep) -> ModelView | JSONResponse:
    for model in _served(state.settings):
        if model.id == model_id:
            return model
    # The code POST /v1/jobs answers a job for a model not served here with, as OpenAI's.
    return JSONResponse(error_body(f"model {model_id!r} is not served here", "model_not_found"), status_code=404)
