"""Load any HF vision-language checkpoint (local dir or hub id) into the pieces the backends need."""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from worker.inference.image_resize import use_torch_resize

if TYPE_CHECKING:
    from common.infra.settings import Settings

log = logging.getLogger(__name__)


@dataclass
class LoadedModel:
    model: Any  # a transformers PreTrainedModel with get_image_features / get_input_embeddings
    processor: Any  # a transformers ProcessorMixin (chat template, image processor, tokenizer)
    tokenizer: Any
    image_token_id: int
    eos_token_ids: list[int] = field(default_factory=list)
    name: str = ""
    # The processor does nothing to a prompt without images but call this tokenizer (probed at load:
    # text_alone_by_tokenizer), so text-only prompts may skip it.
    text_by_tokenizer: bool = False
    # The processor refused images as arrays (worker/inference/preprocess.py), so it is given PIL images.
    images_as_pil: bool = False

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @cached_property
    def max_positions(self) -> int | None:
        text_config = self.model.config.get_text_config()
        return getattr(text_config, "max_position_embeddings", None)


def image_only_processor_class(base: type[Any], name: str | None = None) -> type[Any]:
    """Subclass of a processor class with its video slot removed.

    Processors of video-capable families (Qwen2-VL, InternVL, ...) take a `video_processor`, and every video
    processor needs torchvision, which this project does not install. ProcessorMixin loads and saves the
    sub-processors `get_attributes` names, so dropping the video one there makes it image + tokenizer only. The
    base `__init__` stays: overriding it would lose the processor's own saved kwargs (InternVL's
    image_seq_length) on reload. With `name=base.__name__`, `save_pretrained` writes `processor_class: base`,
    which a machine with torchvision loads as the real class.
    """

    def get_attributes(cls: type) -> list[str]:
        return [name for name in base.get_attributes() if name != "video_processor"]

    return type(name or f"{base.__name__}ImageOnly", (base,),
                {"get_attributes": classmethod(get_attributes), "__module__": __name__})


def load_processor(path_or_id: str, torch_resize: bool = True, **kwargs: Any) -> Any:
    """The checkpoint's processor. `torch_resize`: its image processor resizes with torch's antialiased kernel, as
    HF's torchvision backend does, instead of Pillow (worker/inference/image_resize.py; process-wide)."""
    from transformers import AutoConfig, AutoProcessor
    from transformers.models.auto.processing_auto import PROCESSOR_MAPPING
    from transformers.utils import is_torchvision_available

    use_torch_resize(torch_resize)
    try:
        return AutoProcessor.from_pretrained(path_or_id, **kwargs)
    except Exception as exc:
        if is_torchvision_available():
            raise
        config = AutoConfig.from_pretrained(path_or_id, **kwargs)
        base: Any = PROCESSOR_MAPPING.get(type(config), None)  # a ProcessorMixin subclass
        if base is None or "video_processor" not in base.get_attributes():
            raise
        log.info(
            "processor %s needs torchvision for its video slot (%s); loading it image-only",
            base.__name__,
            exc,
        )
        return image_only_processor_class(base).from_pretrained(path_or_id, **kwargs)


def _image_token_id(model: Any, processor: Any, tokenizer: Any) -> int:
    for candidate in (
        getattr(model.config, "image_token_id", None),
        getattr(model.config, "image_token_index", None),
        getattr(processor, "image_token_id", None),
    ):
        if isinstance(candidate, int):
            return candidate
    token = getattr(processor, "image_token", None) or getattr(tokenizer, "image_token", None)
    if token is None:
        raise ValueError("cannot find the image placeholder token of this model")
    return int(tokenizer.convert_tokens_to_ids(token))


def _eos_token_ids(model: Any, tokenizer: Any) -> list[int]:
    # Chat models often end turns with a token other than the tokenizer's eos (e.g. <|im_end|>); the
    # generation config lists all of them, so take the union.
    ids: list[int] = []
    for source in (getattr(model.generation_config, "eos_token_id", None), tokenizer.eos_token_id):
        if source is None:
            continue
        for tid in source if isinstance(source, (list, tuple)) else [source]:
            if int(tid) not in ids:
                ids.append(int(tid))
    return ids


def model_location(path_or_id: str) -> str:
    """Where to load `path_or_id` from: the bundled demo model's folder for its name, else as given."""
    from common.infra.settings import DEMO_MODEL
    from worker.demo import DEMO_MODEL_DIR

    return str(DEMO_MODEL_DIR) if path_or_id == DEMO_MODEL else path_or_id


def default_max_tokens(path_or_id: str, settings: Settings) -> int:
    """What a request that sets no max_tokens may generate: the model's generation_config.json max_new_tokens
    where it sets one, else VLMQ_DEFAULT_MAX_TOKENS; never over VLMQ_MAX_TOKENS_LIMIT."""
    from transformers import GenerationConfig

    try:
        model_default = GenerationConfig.from_pretrained(model_location(path_or_id)).max_new_tokens
    except (OSError, ValueError):  # no generation_config.json, or a hub id not in the cache (offline)
        model_default = None
    return min(model_default or settings.default_max_tokens, settings.max_tokens_limit)


def load_model(path_or_id: str, device: str = "cpu", dtype: torch.dtype = torch.float32,
               weights: bool = True, torch_resize: bool = True) -> LoadedModel:
    """With `weights=False` the model is built from its config on the meta device: no memory, no load time, and
    everything but a forward works (family, placeholders, positions), which is what a front end that only
    prepares requests for an engine in another process needs."""
    from transformers import AutoConfig, AutoModelForImageTextToText, GenerationConfig

    name = path_or_id
    path_or_id = model_location(path_or_id)
    processor = load_processor(path_or_id, torch_resize=torch_resize)
    tokenizer = processor.tokenizer
    model: Any  # a PreTrainedModel of the checkpoint's VLM class
    if weights:
        model = AutoModelForImageTextToText.from_pretrained(path_or_id, dtype=dtype)
        model.to(device)
    else:
        with torch.device("meta"):
            model = AutoModelForImageTextToText.from_config(AutoConfig.from_pretrained(path_or_id), dtype=dtype)
        # The end-of-turn tokens live in generation_config.json, which from_config does not read.
        with contextlib.suppress(OSError):
            model.generation_config = GenerationConfig.from_pretrained(path_or_id)
    model.eval()
    return LoadedModel(
        model=model,
        processor=processor,
        tokenizer=tokenizer,
        image_token_id=_image_token_id(model, processor, tokenizer),
        eos_token_ids=_eos_token_ids(model, tokenizer),
        # A local dir is named by its folder; a hub id ("org/model") or the demo model's name is already a name.
        name=Path(name).name if Path(name).is_dir() else name,
        text_by_tokenizer=text_alone_by_tokenizer(processor, tokenizer),
    )


# Text a processor might normalise: whitespace around and inside, newlines, tabs, digits, non-ASCII.
_PROBE_TEXT = "  Probe 1: what is 2+2?\n\tCafé naïve 東京 — ok.  \n"


def text_alone_by_tokenizer(processor: Any, tokenizer: Any) -> bool:
    """Whether this processor, given a prompt and no images, returns exactly what its tokenizer does. A
    processor call merges its default kwargs and checks its inputs before it tokenizes, so a text-only prompt
    costs several times the CPU through it (bench/prepare.py). Probed on a prompt of
    the model's own chat template; any difference (a key, a token, an error) keeps the processor for every
    prompt."""
    try:
        messages = [{"role": "user", "content": [{"type": "text", "text": _PROBE_TEXT}]}]
        prompt = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        prompts = [prompt if isinstance(prompt, str) else prompt[0], _PROBE_TEXT]
        for text in prompts:
            by_processor = processor(text=[text], images=None, return_tensors="pt")
            by_tokenizer = tokenizer([text], return_tensors="pt")
            if set(by_processor.keys()) != set(by_tokenizer.keys()) or not all(
                    torch.equal(by_processor[key], by_tokenizer[key]) for key in by_processor):
                return False
    except Exception:  # no chat template, a processor that wants images, ...: keep the processor
        log.debug("text-only prompts keep the processor", exc_info=True)
        return False
    return True
