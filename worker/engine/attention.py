"""Paged attention over a packed ragged batch, plugged into HF models through `AttentionInterface`.

The model runs on one packed sequence `[1, T]` holding every scheduled request's new tokens. HF's attention
module projects and RoPE-rotates q/k/v as usual, then calls `paged_attention`, which writes the new keys and
values into the block pool and attends each request to its own cached context. Metadata (block tables, slots,
masks) is built once per step and shared by every layer.

CPU backend: torch SDPA. Decodes (one query each) are gathered into one padded batch and attended in one call;
prefill chunks are attended one request at a time. A GPU backend can replace `_attend` behind the same
function and metadata.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers import AttentionInterface

ATTN_IMPLEMENTATION = "vlmq_paged"


@dataclass
class PrefillSeq:
    query_start: int          # offset of its first new token in the packed batch
    query_len: int
    slots: torch.Tensor       # [context_len + query_len] cache slots of its whole sequence so far
    mask: torch.Tensor | None  # [query_len, context_len + query_len] bool; None means plain causal (no context)


@dataclass
class DecodeBatch:
    query_index: torch.Tensor  # [B] positions in the packed batch of the decode tokens
    slots: torch.Tensor        # [B, max_len] cache slots, padded with slot 0
    mask: torch.Tensor         # [B, 1, 1, max_len] bool, True where a key is real


@dataclass
class AttentionMetadata:
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]]  # per layer: key, value pools [num_slots, kv_heads, dim]
    slot_mapping: torch.Tensor                          # [T] where each new token's key/value is written
    prefills: list[PrefillSeq]
    decodes: DecodeBatch | None
    num_tokens: int


def build_metadata(
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
    block_size: int,
    seqs: list[tuple[list[int], int, int]],
    device: torch.device,
) -> AttentionMetadata:
    """seqs: per request in packed order (block_ids, context_len, query_len)."""
    slot_mapping: list[int] = []
    prefills: list[PrefillSeq] = []
    decode_index: list[int] = []
    decode_slots: list[list[int]] = []
    offset = 0
    for block_ids, context_len, query_len in seqs:
        total = context_len + query_len
        positions = range(total)
        all_slots = [block_ids[p // block_size] * block_size + p % block_size for p in positions]
        slot_mapping.extend(all_slots[context_len:])
        if query_len == 1 and context_len > 0:
            decode_index.append(offset)
            decode_slots.append(all_slots)
        else:
            mask = None
            if context_len > 0:
                # Query i sits at absolute position context_len + i and sees keys 0..context_len + i.
                q_pos = torch.arange(context_len, total, device=device).unsqueeze(1)
                mask = torch.arange(total, device=device).unsqueeze(0) <= q_pos
            prefills.append(PrefillSeq(offset, query_len, torch.tensor(all_slots, device=device), mask))
        offset += query_len
    decodes = None
    if decode_index:
        max_len = max(len(s) for s in decode_slots)
        slots = torch.zeros((len(decode_slots), max_len), dtype=torch.long)
        mask = torch.zeros((len(decode_slots), 1, 1, max_len), dtype=torch.bool)
        for i, s in enumerate(decode_slots):
            slots[i, : len(s)] = torch.tensor(s)
            mask[i, 0, 0, : len(s)] = True
        decodes = DecodeBatch(torch.tensor(decode_index, device=device), slots.to(device), mask.to(device))
    return AttentionMetadata(kv_caches, torch.tensor(slot_mapping, dtype=torch.long, device=device), prefills,
                             decodes, offset)


def paged_attention(
    module: torch.nn.Module,
    query: torch.Tensor,   # [1, heads, T, dim], RoPE applied
    key: torch.Tensor,     # [1, kv_heads, T, dim]
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    attn_metadata: AttentionMetadata | None = None,
    **kwargs: object,
) -> tuple[torch.Tensor, None]:
    if attn_metadata is None:
        raise RuntimeError("paged attention needs attn_metadata; the model must be driven by the vlmq engine")
    meta = attn_metadata
    k_cache, v_cache = meta.kv_caches[module.layer_idx]  # type: ignore[index]
    k_new = key[0].transpose(0, 1)    # [T, kv_heads, dim]
    v_new = value[0].transpose(0, 1)
    k_cache.index_copy_(0, meta.slot_mapping, k_new.to(k_cache.dtype))
    v_cache.index_copy_(0, meta.slot_mapping, v_new.to(v_cache.dtype))

    q = query[0]  # [heads, T, dim]
    out = torch.empty((q.shape[1], q.shape[0], q.shape[2]), dtype=query.dtype, device=query.device)
    gqa = q.shape[0] != k_cache.shape[1]
    for seq in meta.prefills:
        q_seq = q[:, seq.query_start : seq.query_start + seq.query_len]
        k_seq = k_cache[seq.slots].transpose(0, 1)  # [kv_heads, L, dim]
        v_seq = v_cache[seq.slots].transpose(0, 1)
        o = F.scaled_dot_product_attention(q_seq, k_seq, v_seq, attn_mask=seq.mask, is_causal=seq.mask is None,
                                           scale=scaling, enable_gqa=gqa)
        out[seq.query_start : seq.query_start + seq.query_len] = o.transpose(0, 1)
    if meta.decodes is not None:
        d = meta.decodes
        q_dec = q[:, d.query_index].transpose(0, 1).unsqueeze(2)  # [B, heads, 1, dim]
        k_dec = k_cache[d.slots].transpose(1, 2)                  # [B, kv_heads, max_len, dim]
        v_dec = v_cache[d.slots].transpose(1, 2)
        o = F.scaled_dot_product_attention(q_dec, k_dec, v_dec, attn_mask=d.mask, scale=scaling, enable_gqa=gqa)
        out[d.query_index] = o.squeeze(2)
    return out.unsqueeze(0), None


AttentionInterface.register(ATTN_IMPLEMENTATION, paged_attention)
