"""What the engine needs to know per VLM family, and nothing else: where the decoder and its embeddings are, how
the processor's output splits into per-image inputs, how images from many requests share one vision forward, and
how token positions are laid out (1-D RoPE, or Qwen2-VL's 3-row M-RoPE).

The engine drives `language_model(model)` itself with one packed ragged batch: `inputs_embeds [1, T, H]` (token
embeddings with image features written at the placeholders) and `packed_position_ids(...)`. Each family here was
checked against its HF forward and `generate` (tests/worker/engine/test_families.py).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, TypeAlias

import torch
from torch import nn

# A transformers model or module, used through the names its family gives its parts (model.language_model,
# config.vision_config, q_proj, head_dim): torch types every attribute of an nn.Module as Tensor | Module, which
# says nothing here, so such objects are typed for what they are to this code, duck-typed.
HFModule: TypeAlias = Any

Ids = Sequence[int] | torch.Tensor


def _id_list(input_ids: Ids) -> list[int]:
    if isinstance(input_ids, torch.Tensor):
        return [int(t) for t in input_ids.reshape(-1).tolist()]
    return [int(t) for t in input_ids]


def _runs(ids: list[int], token_id: int) -> list[tuple[int, int]]:
    """(offset, length) of each maximal run of `token_id` in `ids`."""
    runs: list[tuple[int, int]] = []
    for i, tid in enumerate(ids):
        if tid != token_id:
            continue
        if runs and runs[-1][0] + runs[-1][1] == i:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((i, 1))
    return runs


class ModelFamily:
    """A decoder with 1-D RoPE fed by a vision tower that maps each `pixel_values` row to one block of embeddings.

    This base is LLaVA as is; subclasses override where they differ. The object keeps only config values (the
    image token id, the merge size); methods take the model itself, as the engine holds it.
    """

    name = "llava"
    # An image input is a dict of get_image_features kwargs, each batched by concatenating along dim 0;
    # `pooler_output` then has one entry per row of `unit_key` (LLaVA/InternVL: per pixel_values row, i.e. tile;
    # Qwen2-VL: per image_grid_thw row, i.e. image).
    unit_key = "pixel_values"

    def __init__(self, image_token_id: int) -> None:
        self.image_token_id = image_token_id

    # ---------------------------------------------------------------- modules

    def language_model(self, model: HFModule) -> nn.Module:
        """The decoder stack: call it with inputs_embeds, position_ids, attention_mask=None, use_cache=False."""
        return model.model.language_model

    def lm_head(self, model: HFModule) -> nn.Module:
        return model.lm_head

    def embed_tokens(self, model: HFModule) -> nn.Module:
        return model.get_input_embeddings()

    # ---------------------------------------------------------------- images

    def image_spans(self, input_ids: Ids, num_images: int) -> list[tuple[int, int]]:
        """(offset, num_placeholders) of each image's placeholder run in the prompt, in image order.

        Images written back to back with no markup between them (LLaVA's "<image><image>") form one run; every
        family that does that gives all images the same number of placeholders, so such a run is split evenly.
        """
        runs = _runs(_id_list(input_ids), self.image_token_id)
        if len(runs) == num_images:
            return runs
        total = sum(n for _, n in runs)
        if num_images > len(runs) > 0 and total % num_images == 0:
            per = total // num_images
            if all(n % per == 0 for _, n in runs):
                return [(start + k * per, per) for start, n in runs for k in range(n // per)]
        raise ValueError(
            f"cannot split {total} placeholder tokens in {len(runs)} run(s) into {num_images} image(s)"
        )

    def image_inputs(self, encoded: Mapping[str, Any], num_images: int) -> list[dict[str, torch.Tensor]]:
        """The processor's output (one request) cut into per-image vision inputs, in prompt order."""
        if num_images == 0:
            return []
        pixel_values = encoded["pixel_values"]
        if pixel_values.shape[0] != num_images:
            raise ValueError(f"{pixel_values.shape[0]} pixel_values rows for {num_images} image(s)")
        return [{"pixel_values": pixel_values[i : i + 1]} for i in range(num_images)]

    @torch.no_grad()
    def encode_images(self, model: HFModule, inputs: Sequence[Mapping[str, torch.Tensor]]) -> list[torch.Tensor]:
        """Embeddings `[num_placeholders, text_hidden]` per input, one vision forward per group of inputs whose
        tensors can be concatenated (same trailing shape), whatever requests they come from."""
        groups: dict[tuple, list[int]] = {}
        for i, inp in enumerate(inputs):
            key = tuple((name, tuple(t.shape[1:]), t.dtype) for name, t in sorted(inp.items()))
            groups.setdefault(key, []).append(i)
        param = next(model.parameters())
        out: dict[int, torch.Tensor] = {}
        for members in groups.values():
            batch = {}
            for name in inputs[members[0]]:
                tensor = torch.cat([inputs[i][name] for i in members]).to(param.device)
                batch[name] = tensor.to(param.dtype) if tensor.is_floating_point() else tensor
            units = list(model.get_image_features(**batch, return_dict=True).pooler_output)
            first = 0
            for i in members:
                n = inputs[i][self.unit_key].shape[0]
                out[i] = torch.cat([u.reshape(-1, u.shape[-1]) for u in units[first : first + n]])
                first += n
            if first != len(units):
                raise RuntimeError(f"the vision forward gave {len(units)} outputs for {first} units")
        return [out[i] for i in range(len(inputs))]

    # ---------------------------------------------------------------- positions

    def prompt_positions(
        self, input_ids: Ids, image_grid_thw: torch.Tensor | Mapping[str, Any] | None = None
    ) -> tuple[torch.Tensor | None, int]:
        """1-D RoPE: the token at sequence index i sits at position i, so nothing to precompute."""
        return None, 0

    def sequence_positions(
        self, prompt_positions: torch.Tensor | None, rope_delta: int, start: int, num_tokens: int
    ) -> torch.Tensor:
        """Positions of one sequence's tokens [start, start + num_tokens): `[num_tokens]` here."""
        return torch.arange(start, start + num_tokens)

    def packed_position_ids(self, positions: Sequence[torch.Tensor]) -> torch.Tensor:
        """`sequence_positions` of every sequence in one packed batch, in packed order -> `[1, T]`."""
        return torch.cat(list(positions), dim=-1).unsqueeze(0)

    def batch_position_ids(self, spans: Sequence[tuple[torch.Tensor | None, int, int, int]]) -> torch.Tensor:
        """`packed_position_ids` of the sequences `spans` describe, each as `sequence_positions`' arguments
        (prompt positions, rope delta, start, num_tokens). With 1-D RoPE, one vectorised expression: a decode
        step of hundreds of sequences otherwise spends more on the per-sequence aranges than on some layers."""
        if type(self).sequence_positions is not ModelFamily.sequence_positions:
            return self.packed_position_ids([self.sequence_positions(*span) for span in spans])
        counts = torch.tensor([n for _, _, _, n in spans], dtype=torch.long)
        # Token j of the packed batch, in a sequence starting at `start` whose first token sits at `offset`.
        offsets = torch.cumsum(counts, 0) - counts
        starts = torch.tensor([start for _, _, start, _ in spans], dtype=torch.long)
        return (torch.arange(int(counts.sum())) + torch.repeat_interleave(starts - offsets, counts)).unsqueeze(0)


class InternVLFamily(ModelFamily):
    """InternVL (native transformers port): LLaVA-like, but an image is 1..n tiles (`pixel_values` rows), each
    pixel-shuffled to `image_seq_length` embeddings, and the processor does not return per-image tile counts."""

    name = "internvl"

    def image_inputs(self, encoded: Mapping[str, Any], num_images: int) -> list[dict[str, torch.Tensor]]:
        if num_images == 0:
            return []
        pixel_values = encoded["pixel_values"]
        spans = self.image_spans(encoded["input_ids"], num_images)
        # Each image is <img> + <IMG_CONTEXT> * (tokens_per_tile * its tiles) + </img>: read its tiles off that.
        total = sum(n for _, n in spans)
        if total % pixel_values.shape[0]:
            raise ValueError(f"{total} placeholders do not split evenly over {pixel_values.shape[0]} tiles")
        per_tile = total // pixel_values.shape[0]
        out, first = [], 0
        for _, n in spans:
            out.append({"pixel_values": pixel_values[first : first + n // per_tile]})
            first += n // per_tile
        return out


class Qwen2VLFamily(ModelFamily):
    """Qwen2-VL: images are flattened patches plus a (t, h, w) grid row, one vision forward takes any number of
    them (the tower attends within each image through cu_seqlens), and the decoder uses M-RoPE."""

    name = "qwen2_vl"
    unit_key = "image_grid_thw"

    def __init__(self, image_token_id: int, spatial_merge_size: int) -> None:
        super().__init__(image_token_id)
        self.merge = spatial_merge_size

    def image_inputs(self, encoded: Mapping[str, Any], num_images: int) -> list[dict[str, torch.Tensor]]:
        if num_images == 0:
            return []
        pixel_values, grid = encoded["pixel_values"], encoded["image_grid_thw"]
        if grid.shape[0] != num_images:
            raise ValueError(f"{grid.shape[0]} image_grid_thw rows for {num_images} image(s)")
        out, first = [], 0
        for i in range(num_images):
            n = int(grid[i].prod())
            out.append({"pixel_values": pixel_values[first : first + n], "image_grid_thw": grid[i : i + 1]})
            first += n
        if first != pixel_values.shape[0]:
            raise ValueError(f"image_grid_thw covers {first} patches, pixel_values has {pixel_values.shape[0]}")
        return out

    def prompt_positions(
        self, input_ids: Ids, image_grid_thw: torch.Tensor | Mapping[str, Any] | None = None
    ) -> tuple[torch.Tensor | None, int]:
        """M-RoPE positions `[3, prompt_len]` (rows t, h, w) and the delta decode positions carry.

        Text advances t, h and w together; an image's placeholders get (cur + t, cur + h, cur + w) over its merged
        grid and `cur` then moves past the largest (by max(h, w): HF's `get_rope_index`; images have t = 1). A
        token at sequence index i >= prompt_len then sits at i + delta on all three rows.
        """
        grid = image_grid_thw.get("image_grid_thw") if isinstance(image_grid_thw, Mapping) else image_grid_thw
        ids = _id_list(input_ids)
        pieces: list[torch.Tensor] = []
        cur = i = g = 0
        while i < len(ids):
            if ids[i] != self.image_token_id:
                j = i
                while j < len(ids) and ids[j] != self.image_token_id:
                    j += 1
                pieces.append(torch.arange(cur, cur + j - i).expand(3, -1))
                cur += j - i
                i = j
                continue
            if grid is None or g >= len(grid):
                raise ValueError("more image placeholder runs than image_grid_thw rows")
            t, h, w = (int(v) for v in grid[g])
            h, w = h // self.merge, w // self.merge
            n = t * h * w
            if ids[i : i + n] != [self.image_token_id] * n:
                raise ValueError(f"image {g} needs {n} contiguous placeholders at offset {i}")
            tt, hh, ww = torch.meshgrid(torch.arange(t), torch.arange(h), torch.arange(w), indexing="ij")
            pieces.append(torch.stack([tt, hh, ww]).reshape(3, -1) + cur)
            cur += max(h, w)
            i += n
            g += 1
        if grid is not None and g != len(grid):
            raise ValueError(f"{len(grid)} image_grid_thw rows but {g} images in the prompt")
        positions = torch.cat(pieces, dim=1) if pieces else torch.zeros((3, 0), dtype=torch.long)
        return positions, cur - len(ids)

    def sequence_positions(
        self, prompt_positions: torch.Tensor | None, rope_delta: int, start: int, num_tokens: int
    ) -> torch.Tensor:
        """`[4, num_tokens]`: row 0 the plain sequence index (see `packed_position_ids`), rows 1-3 M-RoPE."""
        end = start + num_tokens
        index = torch.arange(start, end)
        prompt_len = 0 if prompt_positions is None else prompt_positions.shape[1]
        mrope = (index + rope_delta).expand(3, -1).clone()
        if prompt_positions is not None and start < prompt_len:
            mrope[:, : min(end, prompt_len) - start] = prompt_positions[:, start : min(end, prompt_len)]
        return torch.cat([index.unsqueeze(0), mrope])

    def packed_position_ids(self, positions: Sequence[torch.Tensor]) -> torch.Tensor:
        """`[4, 1, T]`. Qwen2VLTextModel reads a 4-row position_ids as (text index, t, h, w): it rotates by rows
        1-3 and hands row 0 to the mask builder and, as `position_ids`, to the attention function. Given only the
        3 M-RoPE rows it sets that text row to None and builds one causal mask over the whole packed batch, so
        sequences attend to each other. With row 0 = each sequence's own token index, the mask builder (sdpa,
        eager; flash-attn's varlen path likewise) starts a new sequence wherever row 0 does not advance by exactly
        1. Our paged attention builds no mask and attends within each sequence by its own metadata, so for it row
        0 is informational; it still must be there, or rows would be misread as t, h, w.
        """
        if any(p.shape[0] != 4 for p in positions):
            raise ValueError("Qwen2-VL needs [4, n] positions per sequence; build them with sequence_positions")
        return torch.cat(list(positions), dim=-1).unsqueeze(1)


def attention_window(text_config: object) -> int | None:
    """How many tokens a query sees where some decoder layer's attention slides (None: every layer sees the
    whole context). Up to that length sliding and full attention are the same computation, so the engine,
    which attends to the whole context, caps prompt + output there rather than diverge from the model."""
    window = getattr(text_config, "sliding_window", None)
    if not isinstance(window, int) or window <= 0:
        return None
    layer_types = getattr(text_config, "layer_types", None)
    if layer_types is not None:
        return window if any(t != "full_attention" for t in layer_types) else None
    return None if getattr(text_config, "use_sliding_window", True) is False else window


def _unsupported_attention(text_config: object) -> str | None:
    for name in ("attn_logit_softcapping", "final_logit_softcapping"):
        if getattr(text_config, name, None):
            return f"{name} (the paged attention and logits do not cap)"
    return None


def get_family(model: HFModule) -> ModelFamily:
    """The family adapter of a loaded HF VLM, by its config's model_type."""
    config = model.config
    model_type = getattr(config, "model_type", "")
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    if (problem := _unsupported_attention(text_config)) is not None:
        raise ValueError(f"the paged engine does not run decoders with {problem}")
    image_token_id = getattr(config, "image_token_id", None)
    if not isinstance(image_token_id, int):
        raise ValueError(f"{type(model).__name__} config has no integer image_token_id")
    if model_type == "llava":
        return ModelFamily(image_token_id)
    if model_type == "internvl":
        return InternVLFamily(image_token_id)
    if model_type in ("qwen2_vl", "qwen2_5_vl"):  # 2.5: another tower, the same placeholders and M-RoPE
        return Qwen2VLFamily(image_token_id, config.vision_config.spatial_merge_size)
    raise ValueError(
        f"the paged engine does not support model_type {model_type!r} ({type(model).__name__}) yet; "
        "supported: llava, internvl, qwen2_vl, qwen2_5_vl"
    )
