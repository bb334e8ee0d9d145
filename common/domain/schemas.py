"""Pydantic models at the edges: the chat-completions request a job carries, and the job as shown."""

from __future__ import annotations

import json
from datetime import datetime
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from common.domain import storable

# A job's metadata is echoed in every view and list page of it; past this it belongs in object storage.
MAX_JOB_METADATA_BYTES = 16 * 1024


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text"]
    text: str


class ImageURL(BaseModel):
    model_config = ConfigDict(extra="forbid")
    url: str = Field(description="A data: URL, or the id of an image uploaded to POST /v1/images.")
    detail: Literal["auto", "low", "high"] | None = None


class ImagePart(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["image_url"]
    image_url: ImageURL


ContentPart = Annotated[TextPart | ImagePart, Field(discriminator="type")]


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Literal["system", "user", "assistant", "developer"]
    content: str | list[ContentPart]
    name: str | None = None


class StorableBody(BaseModel):
    """A request body whose every string is valid Unicode and every number finite (common.domain.storable)."""

    @model_validator(mode="before")
    @classmethod
    def _storable(cls, data: Any) -> Any:
        storable.check(data)
        return data


_DEFAULTS: dict[str | None, Any] = {"temperature": 0.0, "top_p": 1.0, "top_k": 0, "n": 1, "stream": False,
                                     "priority": 5}


class ChatCompletionRequest(StorableBody):
    """The body of an OpenAI chat completion, restricted to what vlmq runs."""

    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    # Greedy by default, not OpenAI's 1.0: a batch run twice gives the same answers. null means the default,
    # as OpenAI's API takes it (its client sends null for an argument given as None).
    temperature: float | None = Field(default=_DEFAULTS["temperature"], ge=0.0, le=2.0,
                                      description="0 (the default): greedy.")
    top_p: float | None = Field(default=_DEFAULTS["top_p"], gt=0.0, le=1.0)
    top_k: int | None = Field(default=_DEFAULTS["top_k"], ge=0, description="vLLM-style extension; 0 disables it.")
    # torch seeds a generator from a 64-bit integer; JSON's integers have no bound.
    seed: int | None = Field(default=None, ge=-(2**63), le=2**63 - 1)
    stop: str | list[str] | None = None
    n: Literal[1] | None = 1
    stream: Literal[False] | None = False

    # Runs only for the fields a request gives (a validator after the model would run on every request).
    # `priority` is JobCreate's.
    @field_validator("temperature", "top_p", "top_k", "n", "stream", "priority", mode="before", check_fields=False)
    @classmethod
    def _null_means_default(cls, value: Any, info: ValidationInfo) -> Any:
        return _DEFAULTS[info.field_name] if value is None else value

    @field_validator("stop")
    @classmethod
    def _stop_list(cls, value: str | list[str] | None) -> str | list[str] | None:
        stops = [value] if isinstance(value, str) else (value or [])
        if len(stops) > 4:
            raise ValueError("at most 4 stop sequences are allowed")
        if any(not s for s in stops):
            raise ValueError("stop sequences must be non-empty")
        return value

    @property
    def stop_list(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])


class JobCreate(ChatCompletionRequest):
    priority: int | None = Field(default=_DEFAULTS["priority"], ge=0, le=9, description="0 lowest .. 9 highest.")
    metadata: dict[str, Any] | None = Field(default=None, description=(
        f"Any JSON object, echoed with the job; at most {MAX_JOB_METADATA_BYTES} bytes as JSON."))

    @field_validator("metadata")
    @classmethod
    def _metadata_size(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        if value is not None:
            size = len(json.dumps(value, ensure_ascii=False, separators=(",", ":")).encode("utf-8"))
            if size > MAX_JOB_METADATA_BYTES:
                raise ValueError(f"metadata is {size} bytes as JSON; the limit is {MAX_JOB_METADATA_BYTES}")
        return value


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str
    refusal: None = None


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: None = None
    finish_reason: str


class ChatCompletion(BaseModel):
    """OpenAI's chat.completion object: a job's result (common.domain.views.chat_completion builds it)."""

    id: str = Field(description="chatcmpl-<job id>.")
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class ModelView(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelView]


class JobResultView(BaseModel):
    text: str
    finish_reason: str
    usage: Usage


class JobError(BaseModel):
    code: str
    message: str


class JobView(BaseModel):
    id: str
    object: Literal["job"] = "job"
    status: str
    model: str
    priority: int
    created_at: datetime
    started_at: datetime | None
    finished_at: datetime | None
    attempts: int
    max_attempts: int
    metadata: dict[str, Any] | None
    batch_id: str | None = None
    custom_id: str | None = None
    result: JobResultView | None
    error: JobError | None


class JobList(BaseModel):
    object: Literal["list"] = "list"
    data: list[JobView]
    has_more: bool
    next_cursor: str | None


class ImageView(BaseModel):
    id: str
    object: Literal["image"] = "image"
    sha256: str
    format: str
    width: int
    height: int
    bytes: int
    created_at: datetime


class ErrorDetail(BaseModel):
    message: str
    type: str = Field(description="invalid_request_error, or server_error for a 503.")
    code: str = Field(description="Machine-readable reason, e.g. not_found, invalid_api_key, rate_limit_exceeded.")
    param: str | None = Field(description="The request field at fault, when there is one.")


class ErrorResponse(BaseModel):
    """Every refusal (4xx) and every 503 has this body (OpenAI's error shape)."""

    error: ErrorDetail
