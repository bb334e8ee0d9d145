"""Chat template + processor for one request, with the checks every backend needs. CPU only; runs in the
caller's thread, off the model thread."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from worker.inference.generation import GenerationRequest, InputError
from worker.inference.image_array import for_processor
from worker.inference.model_loader import LoadedModel


@dataclass
class EncodedPrompt:
    input_ids: torch.Tensor  # [prompt_len] long, image placeholders already expanded
    encoded: Any             # the processor's full output (pixel values and any per-image extras)
    num_images: int

    @property
    def prompt_tokens(self) -> int:
        return int(self.input_ids.shape[0])


def image_token(loaded: LoadedModel) -> str:
    return getattr(loaded.processor, "image_token", None) or loaded.tokenizer.convert_ids_to_tokens(
        loaded.image_token_id
    )


def encode_prompt(loaded: LoadedModel, req: GenerationRequest) -> EncodedPrompt:
    req.sampling.validate()
    n_parts = sum(
        1
        for message in req.messages
        if not isinstance(message.get("content"), str)
        for part in message.get("content") or []
        if isinstance(part, dict) and part.get("type") == "image"
    )
    if n_parts != len(req.images):
        raise InputError(f"the messages have {n_parts} image part(s) but {len(req.images)} image(s) were given")
    try:
        prompt = loaded.processor.apply_chat_template(req.messages, add_generation_prompt=True, tokenize=False)
    except Exception as exc:  # template errors come as jinja/ValueError/TypeError alike
        raise InputError(f"cannot render the chat template: {exc}") from exc
    if isinstance(prompt, list):
        prompt = prompt[0]
    # Counted on the rendered prompt too: a user who types the placeholder string would otherwise shift every
    # image into the wrong slot (or crash the processor).
    placeholder = image_token(loaded)
    n_placeholders = prompt.count(placeholder)
    if n_placeholders != len(req.images):
        raise InputError(
            f"the prompt has {n_placeholders} image placeholder(s) ({placeholder!r}) but "
            f"{len(req.images)} image(s) were given"
        )
    rgb = [im if im.mode == "RGB" else im.convert("RGB") for im in req.images]
    # Handed over as arrays: the processor's own conversion of a PIL image copies it more (image_array.py).
    images = rgb if loaded.images_as_pil else [for_processor(im) for im in rgb]
    try:
        if images or not loaded.text_by_tokenizer:
            try:
                encoded = loaded.processor(text=[prompt], images=images or None, return_tensors="pt")
            except TypeError:
                if not images or loaded.images_as_pil:
                    raise
                # Some processors (Idefics2's) load images through a helper that takes PIL images or paths
                # only: this model's get PIL images from now on.
                encoded = loaded.processor(text=[prompt], images=rgb, return_tensors="pt")
                loaded.images_as_pil = True
        else:
            # Text alone: the ids as a list, made a tensor here; the tokenizer's own conversion to tensors costs
            # more than the tokenizing, on the worker's one GIL, for every text row.
            ids = torch.tensor(loaded.tokenizer([prompt])["input_ids"], dtype=torch.long)
            encoded = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}  # the processor's keys
    except ValueError as exc:
        raise InputError(f"cannot preprocess the request: {exc}") from exc
    input_ids = encoded["input_ids"][0].to(torch.long)
    max_positions = loaded.max_positions
    if max_positions is not None and input_ids.shape[0] >= max_positions:
        raise InputError(
            f"the prompt is {input_ids.shape[0]} tokens (images included); this model takes at most "
            f"{max_positions - 1} prompt tokens"
        )
    return EncodedPrompt(input_ids=input_ids, encoded=encoded, num_images=len(images))
