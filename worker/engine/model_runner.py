"""All the torch of the engine: KV pool, vision batches, one packed forward per step, sampling.

The runner turns a `SchedulerOutput`, its whole input, into sampled tokens. It keeps its own state per request
(token ids, block table, image inputs, M-RoPE positions, sampling) from the request's first schedule until the
output names it finished, and the image embeddings by content hash until the output names them freed: the
scheduler's encoder cache only counts them.
"""

from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass, field, replace

import torch

from worker.engine import vision_batches
from worker.engine.attention import ATTN_IMPLEMENTATION, build_metadata
from worker.engine.core.config import EngineConfig
from worker.engine.core.request import ImageItem, images_in
from worker.engine.core.scheduler_output import ScheduledRequest, SchedulerOutput
from worker.engine.families import HFModule, ModelFamily, get_family
from worker.engine.request_state import RequestState
from worker.engine.sampler import Sampler
from worker.inference.generation import GenerationRequest, InputError
from worker.inference.model_loader import LoadedModel
from worker.inference.preprocess import encode_prompt

log = logging.getLogger(__name__)


@dataclass
class PreparedInput:
    """What `prepare` made of a request in the caller's thread: token ids, image items, per-image tensors."""

    request: GenerationRequest
    prompt_token_ids: list[int]
    images: list[ImageItem]
    image_inputs: list[dict[str, torch.Tensor]] = field(default_factory=list)
    mrope_positions: torch.Tensor | None = None  # [3, prompt_len] for M-RoPE families
    mrope_delta: int = 0


def prepare_input(loaded: LoadedModel, family: ModelFamily, req: GenerationRequest) -> PreparedInput:
    """Template, tokenise and preprocess one request (CPU). Needs the processor and the config, not the weights,
    so a front end without them (`load_model(weights=False)`) prepares what an engine elsewhere runs."""
    prompt = encode_prompt(loaded, req)
    ids = prompt.input_ids.tolist()
    image_inputs = family.image_inputs(prompt.encoded, prompt.num_images)
    try:
        runs = family.image_spans(ids, prompt.num_images)
    except ValueError as exc:
        raise InputError(f"image placeholders do not match the images: {exc}") from exc
    images = [
        ImageItem(content_hash=_tensor_hash(inputs, req.cache_salt), offset=start, num_tokens=length)
        for (start, length), inputs in zip(runs, image_inputs, strict=True)
    ]
    positions, delta = family.prompt_positions(prompt.input_ids, prompt.encoded)
    return PreparedInput(req, ids, images, image_inputs, positions, delta)


def without_decoded_images(prepared: PreparedInput) -> PreparedInput:
    """The pixels are in image_inputs: the decoded images need not cross a pipe to another process, nor stay
    in memory while the request waits and runs."""
    return replace(prepared, request=replace(prepared.request, images=[]))


def _kv_geometry(model: HFModule) -> tuple[int, int, int]:
    text = model.config.get_text_config()
    heads = text.num_attention_heads
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    return text.num_hidden_layers, kv_heads, head_dim


def _available_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free)
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 4 << 30


def num_kv_blocks_for(model: HFModule, config: EngineConfig, device: torch.device,
                      max_model_len: int | None) -> int:
    """The configured pool, or a fraction of free memory, never more than max_num_seqs full sequences need."""
    if config.num_kv_blocks is not None:
        return config.num_kv_blocks
    layers, kv_heads, head_dim = _kv_geometry(model)
    bytes_per_block = 2 * layers * config.block_size * kv_heads * head_dim * model.dtype.itemsize
    by_memory = int(_available_bytes(device) * config.kv_cache_fraction) // bytes_per_block
    if max_model_len is not None:
        by_memory = min(by_memory, config.max_num_seqs * -(-max_model_len // config.block_size))
    return max(16, by_memory)


class ModelRunner:
    def __init__(self, loaded: LoadedModel, config: EngineConfig, num_blocks: int) -> None:
        self.loaded = loaded
        self.model = loaded.model
        self.config = config
        self.device = loaded.device
        self.family: ModelFamily = get_family(self.model)
        self._switch_text_attention()
        self.language_model = self.family.language_model(self.model)
        compiled: list[torch.nn.Module] = []
        if config.compile_layers:
            from worker.engine.layer_compiler import compile_decoder_layers

            compiled = compile_decoder_layers(self.language_model)
        self.num_compiled_layers = len(compiled)
        if self.device.type == "cpu" and config.cpu_packed_linear:
            from worker.engine.cpu_linear import pack_linears

            pack_linears(self.model, skip=compiled)  # inductor cannot lower the packed op
        self.num_fused_modules = self.num_rotary_modules = 0
        if self.device.type == "cpu" and config.cpu_fused_elementwise:
            from worker.engine import cpu_kernels
            from worker.engine.cpu_fused import fuse_elementwise
            from worker.engine.cpu_rope import fuse_rotary

            kernels = cpu_kernels.fused_elementwise()
            self.num_fused_modules = fuse_elementwise(self.model, kernels, skip=compiled)
            self.num_rotary_modules = fuse_rotary(self.language_model, kernels, skip=compiled)
        self.lm_head = self.family.lm_head(self.model)
        self.embed_tokens = self.family.embed_tokens(self.model)
        layers, kv_heads, head_dim = _kv_geometry(self.model)
        shape = (num_blocks, config.block_size, kv_heads, head_dim)
        self.kv_caches = [
            (torch.zeros(shape, dtype=self.model.dtype, device=self.device),
             torch.zeros(shape, dtype=self.model.dtype, device=self.device))
            for _ in range(layers)
        ]
        self.sampler = Sampler(self.device)
        self.decode_kernel = None
        if self.device.type == "cpu" and config.cpu_attention_kernel:
            from worker.engine import cpu_kernels

            self.decode_kernel = cpu_kernels.paged_decode_attention()
        self.requests: dict[str, RequestState] = {}
        self.embeddings: dict[str, torch.Tensor] = {}  # by content hash: the hashes the encoder cache counts
        # Vision on its own CUDA stream, overlapping the forward of requests that do not wait for it. Off on CPU,
        # where there is nothing to overlap with; `overlap_vision=True` there still exercises the split path.
        on_cuda = self.device.type == "cuda"
        self.overlap_vision = config.overlap_vision if config.overlap_vision is not None else on_cuda
        self.vision_stream = torch.cuda.Stream(self.device) if self.overlap_vision and on_cuda else None
        self.num_vision_forwards = 0
        # Sizes of the vision forwards not yet reported (worker/engine/vision_batches.py).
        self.vision_batch_sizes: list[int] = []
        self.num_vision_images = 0

    def _switch_text_attention(self) -> None:
        """Only the language model uses paged attention; the vision tower keeps SDPA."""
        text_config = self.model.config.get_text_config()
        if text_config is self.model.config:
            self.model.set_attn_implementation(ATTN_IMPLEMENTATION)
            return
        key = next(k for k in self.model.config.sub_configs if getattr(self.model.config, k) is text_config)
        self.model.set_attn_implementation({key: ATTN_IMPLEMENTATION})

    # ------------------------------------------------------------------ caller's thread

    def prepare(self, req: GenerationRequest) -> PreparedInput:
        # The decoded images are in image_inputs now; kept, they would outlive the worker's pixel budget
        # (worker/inference/pixel_budget.py) for as long as the request runs.
        return without_decoded_images(prepare_input(self.loaded, self.family, req))

    # ------------------------------------------------------------------ engine thread

    def _update_states(self, out: SchedulerOutput) -> None:
        """Bring the runner's own state up to date; the order matters (see scheduler_output.py)."""
        for request_id in out.finished_ids:
            self.requests.pop(request_id, None)
            self.sampler.forget(request_id)
        for content_hash in out.freed_encoder_hashes:
            self.embeddings.pop(content_hash, None)
        for request_id in out.preempted_ids:
            self.requests[request_id].block_ids.clear()  # freed; admitted again, it gets a whole new table
        for new in out.new_requests:
            self.sampler.forget(new.request_id)  # a retry under a reused id starts from its seed again
            self.requests[new.request_id] = RequestState.of(new)
        for s in out.scheduled:
            if s.new_block_ids:
                self.requests[s.request_id].block_ids.extend(s.new_block_ids)

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> dict[str, int]:
        self._update_states(out)
        sampled = self._run(out)
        # Only once the whole step ran: a step that raises leaves no token the scheduler never saw.
        for request_id, token in sampled.items():
            self.requests[request_id].token_ids.append(token)
        return sampled

    def _run(self, out: SchedulerOutput) -> dict[str, int]:
        if not out.encoder_inputs:
            return self._forward(out.scheduled)
        if not self.overlap_vision:
            self._encode(out)
            return self._forward(out.scheduled)
        # Overlap: the vision batch runs on its own stream while requests that need none of this step's new
        # images (decodes, text and cached-image chunks) run their forward; the rest follow once it is done.
        new_hashes = {e.content_hash for e in out.encoder_inputs}
        waiting = [s for s in out.scheduled if any(
            im.content_hash in new_hashes
            for im in images_in(self.requests[s.request_id].images, s.start, s.start + s.num_tokens))]
        ready = [s for s in out.scheduled if s not in waiting]
        done = self._encode(out, stream=self.vision_stream)
        sampled = self._forward(ready)
        if done is not None:
            torch.cuda.current_stream(self.device).wait_event(done)
        sampled.update(self._forward(waiting))
        return sampled

    def _forward(self, scheduled: list[ScheduledRequest]) -> dict[str, int]:
        """One packed forward over `scheduled`; returns the tokens sampled for those that sample."""
        if not scheduled:
            return {}
        states = [self.requests[s.request_id] for s in scheduled]
        token_ids: list[int] = []
        spans: list[tuple[torch.Tensor | None, int, int, int]] = []
        seqs: list[tuple[list[int], int, int]] = []
        for s, state in zip(scheduled, states, strict=True):
            token_ids.extend(state.token_ids[s.start : s.start + s.num_tokens])
            spans.append((state.tensors.mrope_positions, state.tensors.mrope_delta, s.start, s.num_tokens))
            seqs.append((state.block_ids, s.start, s.num_tokens))
        ids = torch.tensor(token_ids, dtype=torch.long, device=self.device)
        embeds = self.embed_tokens(ids)
        offset = 0
        for s, state in zip(scheduled, states, strict=True):
            for image in images_in(state.images, s.start, s.start + s.num_tokens):
                rows = self.embeddings[image.content_hash]
                first = offset + image.offset - s.start
                embeds[first : first + image.num_tokens] = rows.to(embeds.dtype)
            offset += s.num_tokens
        meta = build_metadata(self.kv_caches, self.config.block_size, seqs, self.device, self.decode_kernel)
        position_ids = self.family.batch_position_ids(spans)
        hidden = self.language_model(
            inputs_embeds=embeds.unsqueeze(0), position_ids=position_ids.to(self.device), attention_mask=None,
            use_cache=False, attn_metadata=meta,
        ).last_hidden_state[0]
        sampling = [(s.request_id, state.sampling, offset_end - 1)
                    for s, state, offset_end in zip(scheduled, states, _cumsum(seqs), strict=True) if s.samples]
        if not sampling:
            return {}
        rows = torch.tensor([row for _, _, row in sampling], device=self.device)
        logits = self.lm_head(hidden[rows]).float()
        request_ids = [request_id for request_id, _, _ in sampling]
        tokens = self.sampler.sample(logits, request_ids, [params for _, params, _ in sampling])
        return dict(zip(request_ids, tokens, strict=True))

    def _encode(self, out: SchedulerOutput, stream: torch.cuda.Stream | None = None) -> torch.cuda.Event | None:
        """Run this step's vision batch; on a CUDA side stream, returns the event that marks its end."""
        inputs = [self.requests[e.request_id].tensors.image_inputs[e.image_index] for e in out.encoder_inputs]
        if stream is not None:
            stream.wait_stream(torch.cuda.current_stream(self.device))  # its inputs were written on the main one
            with torch.cuda.stream(stream):
                embeddings = self.family.encode_images(self.model, inputs)
                done = torch.cuda.Event()
                done.record(stream)
            for emb in embeddings:  # made on the side stream, read and freed on the main one
                emb.record_stream(torch.cuda.current_stream(self.device))
        else:
            embeddings = self.family.encode_images(self.model, inputs)
            done = None
        self.num_vision_forwards += 1
        self.num_vision_images += len(inputs)
        vision_batches.record(self.vision_batch_sizes, (len(inputs),))
        for e, emb in zip(out.encoder_inputs, embeddings, strict=True):
            self.embeddings[e.content_hash] = emb
        return done


def _cumsum(seqs: list[tuple[list[int], int, int]]) -> list[int]:
    total, out = 0, []
    for _, _, n in seqs:
        total += n
        out.append(total)
    return out


def _tensor_hash(inputs: dict[str, torch.Tensor], salt: str) -> str:
    """Identity of an image as the model sees it (its preprocessed tensors) within `salt`: the encoder cache
    shares embeddings only between requests of the same salt."""
    digest = hashlib.sha256(salt.encode() + b"\0")
    for name in sorted(inputs):
        tensor = inputs[name].detach().contiguous().cpu()
        digest.update(name.encode())
        digest.update(str(tuple(tensor.shape)).encode())
        digest.update(tensor.view(torch.uint8).numpy().tobytes() if tensor.numel() else b"")
    return digest.hexdigest()
