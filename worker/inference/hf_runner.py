"""Interim backend: cross-request batched generation on top of HF `model.generate`.

One `generate(batch)` call runs the vision tower once over every image of every request (grouped by pixel
shape), merges the image embeddings into the token embeddings at the placeholder positions, left-pads the
whole batch into one `inputs_embeds` tensor and decodes all requests together in a single `model.generate`
call. Greedy requests get exactly the tokens HF `generate` gives for that request alone; sampled requests
draw from their own seeded generator, so a seed reproduces its output whatever else shares the batch.

It serves the models the paged engine (worker/engine) does not; it pads, so it wastes compute on ragged
batches. Models or requests that cannot be batched this way (see HFBatchRunner) run one at a time through
`generate` on the processor's own outputs.
"""

from __future__ import annotations

import copy
import inspect
import secrets
from collections import defaultdict
from dataclasses import dataclass, field, replace
from typing import Any, cast

import torch
from transformers import LogitsProcessor, LogitsProcessorList, StoppingCriteria, StoppingCriteriaList

from worker.engine.sampler import top_p_filter
from worker.inference.generation import GenerationRequest, GenerationResult, SamplingParams, cut_at_stop_strings
from worker.inference.model_loader import LoadedModel
from worker.inference.preprocess import encode_prompt

# Processor outputs that describe the text side; everything else the processor returns is per-image input to
# `get_image_features` (pixel_values, image_sizes, ...).
_TEXT_KEYS = frozenset({"input_ids", "attention_mask", "token_type_ids", "mm_token_type_ids"})


@dataclass
class PreparedRequest:
    request: GenerationRequest
    input_ids: torch.Tensor  # [prompt_len] long, image placeholders already expanded
    # One dict per image, each tensor with a leading dim of 1, ready to be concatenated across requests.
    image_inputs: list[dict[str, torch.Tensor]] = field(default_factory=list)
    # max_tokens, clamped so the prompt plus the completion fit the model's positions.
    max_new_tokens: int = 0
    # The processor's whole output, for a request that runs through generate alone (see HFBatchRunner).
    encoded: dict[str, Any] | None = None

    @property
    def prompt_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def sampling(self) -> SamplingParams:
        return self.request.sampling


class _PerRowSampler(LogitsProcessor):
    """Samples rows with temperature > 0 from their own generator; leaves greedy rows untouched.

    HF's own sampling draws one multinomial over the whole batch from the global RNG, so a seeded request's
    output would depend on its batch neighbours. Here each sampled row picks its token from its own generator
    and its scores are replaced by a one-hot, which generate's greedy argmax then selects.
    """

    def __init__(self, params: list[SamplingParams], device: torch.device) -> None:
        self.params = params
        self.generators: list[torch.Generator | None] = []
        for p in params:
            if p.greedy:
                self.generators.append(None)
                continue
            gen = torch.Generator(device=device)
            gen.manual_seed(p.seed if p.seed is not None else secrets.randbits(63))
            self.generators.append(gen)

    def __call__(self, input_ids: torch.LongTensor, scores: torch.Tensor) -> torch.Tensor:
        out = scores
        for row, (p, gen) in enumerate(zip(self.params, self.generators, strict=True)):
            if gen is None:
                continue
            logits = scores[row].float() / p.temperature
            if p.top_p < 1.0:
                logits = top_p_filter(logits, p.top_p)
            token = torch.multinomial(torch.softmax(logits, dim=-1), 1, generator=gen)
            if out is scores:
                out = scores.clone()
            out[row] = float("-inf")
            out[row, token] = 0.0
        return out


class _PerRowStop(StoppingCriteria):
    """Ends a row at its own max_new_tokens or once a stop string shows up in its text.

    Without it every row runs to the batch's largest max_tokens; finished rows are padded by generate, so the
    batch ends as soon as its last live row does.
    """

    def __init__(self, prepared: list[PreparedRequest], tokenizer: Any, start: int) -> None:
        self.limits = [p.max_new_tokens for p in prepared]
        self.stops = [p.sampling.stop for p in prepared]
        self.tokenizer = tokenizer
        self.start = start  # generate's input_ids hold only generated tokens when it is fed inputs_embeds

    def __call__(self, input_ids: torch.LongTensor, scores: Any, **kwargs: Any) -> torch.BoolTensor:
        n_new = input_ids.shape[1] - self.start
        done = torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)
        for row, (limit, stops) in enumerate(zip(self.limits, self.stops, strict=True)):
            if n_new >= limit:
                done[row] = True
            elif stops and n_new > 0:
                # Byte-level tokens can carry a single byte, so a stop string spans at most its UTF-8 length.
                window = max(len(s.encode()) for s in stops) + 4
                tail = input_ids[row, max(self.start, input_ids.shape[1] - window) :].tolist()
                text = self.tokenizer.decode(tail, skip_special_tokens=True)
                done[row] = any(s in text for s in stops)
        return cast(torch.BoolTensor, done)  # a bool tensor: StoppingCriteria names the legacy class


class HFBatchRunner:
    def __init__(self, loaded: LoadedModel) -> None:
        self.loaded = loaded
        self.model = loaded.model
        self.processor = loaded.processor
        self.tokenizer = loaded.tokenizer
        # Rust tokenizers raise "Already borrowed" when one thread encodes (prepare, on the caller's threads)
        # while another mutates or reads the same object; decoding in generate() gets its own copy.
        self._decoder = copy.deepcopy(loaded.tokenizer)
        self.image_token_id = loaded.image_token_id
        self.eos_token_ids = set(loaded.eos_token_ids)
        self.max_positions = loaded.max_positions
        pad = self.tokenizer.pad_token_id
        self.pad_token_id = int(pad if pad is not None else loaded.eos_token_ids[0])
        # Requests are batched as image features merged into one padded inputs_embeds. A model that cannot
        # take that runs each request through generate on its processor's own outputs instead (slower, and
        # exactly HF's answer): one without get_image_features (Mllama attends to images across layers), one
        # whose generate refuses inputs_embeds (Gemma3, PaliGemma: their image tokens attend both ways by
        # token_type_ids), or one with multimodal RoPE (Qwen-VL, GLM-4V), whose positions come from the image
        # grids inside the model: a bare embeddings batch would get 1-D positions and wrong outputs.
        rope = getattr(self.model.config.get_text_config(), "rope_parameters", None) or {}
        takes_embeds = "inputs_embeds" in inspect.signature(self.model.prepare_inputs_for_generation).parameters
        self.batchable = (hasattr(self.model, "get_image_features") and takes_embeds
                          and "mrope_section" not in rope)

    # ---------------------------------------------------------------- CPU side (caller's thread)

    def prepare(self, req: GenerationRequest) -> PreparedRequest:
        prompt = encode_prompt(self.loaded, req)
        max_new = req.sampling.max_tokens
        if self.max_positions is not None:
            max_new = min(max_new, self.max_positions - prompt.prompt_tokens)
        image_inputs, encoded = [], None
        if self.batchable:
            try:
                image_inputs = self._split_per_image(prompt.encoded, prompt.num_images)
            except NotImplementedError:  # tiles, or several images in one row (Idefics3, Aya Vision): alone
                encoded = dict(prompt.encoded)
        else:
            encoded = dict(prompt.encoded)
        # Without the decoded images: the processor's outputs hold the pixels, and the decoded ones would
        # outlive the worker's pixel budget (worker/inference/pixel_budget.py) while the request waits and runs.
        return PreparedRequest(request=replace(req, images=[]), input_ids=prompt.input_ids,
                               image_inputs=image_inputs, max_new_tokens=max_new, encoded=encoded)

    @staticmethod
    def _split_per_image(encoded: Any, n_images: int) -> list[dict[str, torch.Tensor]]:
        if n_images == 0:
            return []
        per_image: list[dict[str, torch.Tensor]] = [{} for _ in range(n_images)]
        for key, value in encoded.items():
            if key in _TEXT_KEYS or not isinstance(value, torch.Tensor):
                continue
            if value.shape[0] != n_images:
                # Packed layouts (Qwen2-VL's flattened patches) have no per-image leading dim to batch on.
                raise NotImplementedError(f"processor output {key!r} is not laid out one row per image")
            for i in range(n_images):
                per_image[i][key] = value[i : i + 1]
        return per_image

    # ---------------------------------------------------------------- model side

    @torch.inference_mode()
    def generate(self, batch: list[PreparedRequest]) -> list[GenerationResult]:
        together = [p for p in batch if p.encoded is None]
        batched = iter(self._generate_together(together) if together else [])
        return [next(batched) if p.encoded is None else self._generate_alone(p) for p in batch]

    def _generate_alone(self, prepared: PreparedRequest) -> GenerationResult:
        """HF generate on the request's processor outputs, as a user of the model would call it."""
        assert prepared.encoded is not None
        device, dtype = self.loaded.device, self.model.dtype
        inputs = {k: (v.to(device, dtype) if v.is_floating_point() else v.to(device))
                  if isinstance(v, torch.Tensor) else v for k, v in prepared.encoded.items()}
        prompt_len = int(inputs["input_ids"].shape[1])
        params = [prepared.sampling]
        out = self.model.generate(
            **inputs,
            max_new_tokens=prepared.max_new_tokens,
            do_sample=False,
            logits_processor=LogitsProcessorList([_PerRowSampler(params, device)]) if not params[0].greedy else None,
            stopping_criteria=StoppingCriteriaList([_PerRowStop([prepared], self._decoder, start=prompt_len)]),
            eos_token_id=sorted(self.eos_token_ids),
            pad_token_id=self.pad_token_id,
        )
        return self._finish(prepared, out[0, prompt_len:].tolist())

    def _generate_together(self, batch: list[PreparedRequest]) -> list[GenerationResult]:
        device = self.loaded.device
        features = self._encode_images(batch, device)
        embeds, attention_mask = self._build_inputs(batch, features, device)
        params = [p.sampling for p in batch]
        sampler = _PerRowSampler(params, device)
        max_new = max(p.max_new_tokens for p in batch)
        out = self.model.generate(
            inputs_embeds=embeds,
            attention_mask=attention_mask,
            max_new_tokens=max_new,
            do_sample=False,  # sampled rows are drawn by _PerRowSampler, see there
            logits_processor=LogitsProcessorList([sampler]) if any(not p.greedy for p in params) else None,
            stopping_criteria=StoppingCriteriaList([_PerRowStop(batch, self._decoder, start=0)]),
            eos_token_id=sorted(self.eos_token_ids),
            pad_token_id=self.pad_token_id,
        )
        # Fed only inputs_embeds, decoder-only generate returns just the new tokens.
        if out.shape[1] > max_new:
            raise RuntimeError(f"generate returned {out.shape[1]} tokens for max_new_tokens={max_new}")
        return [self._finish(p, out[i].tolist()) for i, p in enumerate(batch)]

    def _encode_images(self, batch: list[PreparedRequest], device: torch.device) -> list[list[torch.Tensor]]:
        """Image embeddings per request, per image; one vision forward per distinct input shape."""
        groups: dict[tuple, list[tuple[int, int]]] = defaultdict(list)
        for r, prepared in enumerate(batch):
            for i, inputs in enumerate(prepared.image_inputs):
                key = tuple(sorted((k, tuple(v.shape[1:])) for k, v in inputs.items()))
                groups[key].append((r, i))
        features: list[list[torch.Tensor | None]] = [[None] * len(p.image_inputs) for p in batch]
        dtype = self.model.dtype
        for members in groups.values():
            kwargs = {}
            for name in batch[members[0][0]].image_inputs[members[0][1]]:
                stacked = torch.cat([batch[r].image_inputs[i][name] for r, i in members]).to(device)
                kwargs[name] = stacked.to(dtype) if stacked.is_floating_point() else stacked
            pooled = self.model.get_image_features(**kwargs, return_dict=True).pooler_output
            if isinstance(pooled, torch.Tensor):
                pooled = list(pooled) if pooled.dim() == 3 else [pooled]
            if len(pooled) != len(members):
                raise RuntimeError(
                    f"vision tower returned {len(pooled)} embeddings for {len(members)} images"
                )
            for (r, i), emb in zip(members, pooled, strict=True):
                features[r][i] = emb
        return features  # type: ignore[return-value]

    def _build_inputs(
        self, batch: list[PreparedRequest], features: list[list[torch.Tensor]], device: torch.device
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # Left padding keeps every row's last prompt token in the last column, where generate reads the
        # logits; generate derives position_ids from the mask (cumsum - 1), so each row sees positions
        # 0..len-1 exactly as when it runs alone.
        width = max(p.prompt_tokens for p in batch)
        ids = torch.full((len(batch), width), self.pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for row, p in enumerate(batch):
            ids[row, width - p.prompt_tokens :] = p.input_ids
            mask[row, width - p.prompt_tokens :] = 1
        ids, mask = ids.to(device), mask.to(device)
        embeds = self.model.get_input_embeddings()(ids)
        image_mask = ids == self.image_token_id
        flat = [emb for per_request in features for emb in per_request]
        if flat:
            merged = torch.cat(flat).to(embeds.device, embeds.dtype)
            if merged.shape[0] != int(image_mask.sum()):
                raise RuntimeError(
                    f"{int(image_mask.sum())} image placeholder tokens but {merged.shape[0]} image embeddings"
                )
            # masked_scatter fills in row-major order: request by request, image by image, as listed.
            embeds = embeds.masked_scatter(image_mask.unsqueeze(-1), merged)
        elif image_mask.any():
            raise RuntimeError("image placeholder tokens without images")
        return embeds, mask

    def _finish(self, prepared: PreparedRequest, generated: list[int]) -> GenerationResult:
        tokens = generated[: prepared.max_new_tokens]
        finish_reason = "length"
        for k, tok in enumerate(tokens):
            if tok in self.eos_token_ids:
                # The EOS token was generated and paid for, so it counts; decoding drops it from the text.
                tokens = tokens[: k + 1]
                finish_reason = "stop"
                break
        tokens, text, stopped = cut_at_stop_strings(
            tokens, lambda t: self._decoder.decode(t, skip_special_tokens=True), prepared.sampling.stop
        )
        if stopped:
            finish_reason = "stop"
        return GenerationResult(
            request_id=prepared.request.request_id,
            text=text,
            token_ids=tokens,
            finish_reason=finish_reason,
            prompt_tokens=prepared.prompt_tokens,
            completion_tokens=len(tokens),
        )
