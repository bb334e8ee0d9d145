"""A JSON request body read by hand (the submission routes parse it themselves, so a large one can go to the
thread pool): loaded as untrusted JSON, then validated into its pydantic model with FastAPI's 422 shape."""

from __future__ import annotations

from typing import Any, TypeVar

from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ValidationError

from common.domain import storable
from common.domain.submission import SubmissionError

Model = TypeVar("Model", bound=BaseModel)

# Parsing and validating take time in proportion to the body: past this, the thread pool does it.
INLINE_BODY_BYTES = 64 * 1024


def load_object(raw: bytes) -> dict[str, Any]:
    try:
        payload = storable.loads(raw)
    except (ValueError, RecursionError) as exc:  # also integers over 4300 digits, nesting past the stack
        raise SubmissionError(f"request body is not valid JSON: {exc}") from None
    if not isinstance(payload, dict):
        raise SubmissionError("request body must be a JSON object")
    return payload


def validate(payload: Any, model: type[Model]) -> Model:
    try:
        return model.model_validate(payload)
    except ValidationError as exc:
        raise RequestValidationError(
            [{**e, "loc": ("body", *e["loc"])} for e in exc.errors(include_url=False, include_context=False)]
        ) from None


def parse(raw: bytes, model: type[Model]) -> Model:
    return validate(load_object(raw), model)


def body_schema(model: type[BaseModel]) -> dict[str, Any]:
    """`model`'s JSON schema for a route's openapi_extra, which has no components: every `#/$defs/...`
    reference replaced by what it names (the body is read by hand, so FastAPI cannot document it)."""
    schema = model.model_json_schema()
    inlined: dict[str, Any] = _inline(schema, schema.get("$defs", {}))
    return inlined


def _inline(schema: Any, defs: dict[str, Any]) -> Any:
    if isinstance(schema, dict):
        ref = schema.get("$ref", "")
        if ref.startswith("#/$defs/"):
            rest = {k: v for k, v in schema.items() if k != "$ref"}
            return _inline({**defs[ref.removeprefix("#/$defs/")], **rest}, defs)
        return {k: _inline(v, defs) for k, v in schema.items() if k != "$defs"}
    if isinstance(schema, list):
        return [_inline(v, defs) for v in schema]
    return schema
