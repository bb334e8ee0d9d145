"""Paged attention over a packed ragged batch, plugged into HF models through `AttentionInterface`.

The model runs on one packed sequence `[1, T]` holding every scheduled request's new tokens. HF's attention
module projects and RoPE-rotates q/k/v as usual, then calls `paged_attention`, which writes the new keys and
values into the block pool and attends each request to its own cached context. Metadata (block tables, slots,
masks) is built once per step and shared by every layer.

CPU backend: decodes (one query each) are attended straight from the pool by a C++ kernel
(worker/engine/cpu_kernels.py) when it is built; otherwise they are gathered into one padded batch and attended
in one torch SDPA call. Prompts of similar lengths are padded into one SDPA call per group: fresh ones (no
cached context) attend their new keys directly, those that continue a context (a prefix-cache hit, a chunk of
a long prompt) attend their whole blocks, gathered from the pool. Longer ones are attended one at a time.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from transformers import AttentionInterface

if TYPE_CHECKING:
    from worker.engine.families import HFModule

ATTN_IMPLEMENTATION = "vlmq_paged"
# Prompts up to this long (new tokens for fresh ones, context + new tokens for the others) are grouped by
# length (powers of two) into padded SDPA calls: for short prompts a call's dispatch costs more than its
# FLOPs, and padding to a power of two bounds the FLOPs wasted. Longer prompts, where those FLOPs matter, keep
# a call of their own.
GROUP_MAX_LEN = 256


@dataclass
class PrefillSeq:
    query_start: int           # offset of its first new token in the packed batch
    query_len: int
    total_len: int             # context + new tokens
    blocks: torch.Tensor       # [ceil(total_len / block_size)] its block ids
    mask: torch.Tensor | None  # [query_len, total_len] bool; None means plain causal (no context)


@dataclass
class PaddedGroup:
    """Prompts of similar lengths attended in one padded SDPA call. Fresh prompts (no cached context) attend
    their new keys directly; prompts that continue a context attend their whole blocks, gathered from the pool
    (their new keys are in it by then)."""
    index: torch.Tensor        # [n, Lq] packed-batch positions of each prompt's new tokens; padding repeats its last
    # [n, 1, Lq, Lk] bool: query j sees its own prompt's keys up to its position. None for fresh prompts: each
    # one's padding comes after its real tokens, so causality alone keeps a real query off them, and SDPA's
    # causal path bounds the keys in the kernel where a mask is built, read and added.
    mask: torch.Tensor | None
    valid: torch.Tensor        # [n_real] long: which of the n * Lq padded rows hold real tokens
    rows: torch.Tensor         # packed-batch positions of the real rows, in the order `valid` selects them
    blocks: torch.Tensor | None = None  # [n, W] block tables, padded with block 0 (Lk = W * block_size); None: fresh


@dataclass
class DecodeBatch:
    query_index: torch.Tensor  # [B] positions in the packed batch of the decode tokens
    blocks: torch.Tensor       # [B, max_blocks] block tables, padded with block 0
    mask: torch.Tensor         # [B, 1, 1, max_blocks * block_size] bool, True where a key is real
    seq_lens: torch.Tensor     # [B] keys per sequence (context + this token)


@dataclass
class AttentionMetadata:
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]]  # per layer: key, value pools [blocks, block_size, kv, dim]
    slot_mapping: torch.Tensor                          # [T] flat slot each new token's key/value goes to
    prefills: list[PrefillSeq]
    decodes: DecodeBatch | None
    num_tokens: int
    prefill_groups: list[PaddedGroup]   # fresh prompts
    context_groups: list[PaddedGroup]   # prompts continuing a cached context
    # (q [B, heads, dim], k pool, v pool, block tables, seq lens, scale) -> [B, heads, dim]; None: gather + SDPA
    decode_kernel: Callable[..., torch.Tensor] | None = None


def build_metadata(
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
    block_size: int,
    seqs: list[tuple[list[int], int, int]],
    device: torch.device,
    decode_kernel: Callable[..., torch.Tensor] | None = None,
) -> AttentionMetadata:
    """seqs: per request in packed order (block_ids, context_len, query_len). Built once per step, vectorised:
    Python work here is per request, never per token."""
    n = len(seqs)
    context = torch.tensor([c for _, c, _ in seqs], dtype=torch.long)
    query = torch.tensor([q for _, _, q in seqs], dtype=torch.long)
    total = context + query
    blocks_needed = [(c + q + block_size - 1) // block_size for _, c, q in seqs]
    num_blocks = torch.tensor(blocks_needed, dtype=torch.long)
    width = max(blocks_needed)
    # One tensor from padded lists: a torch.tensor call per row cost more than the rest of this function.
    rows = zip(seqs, blocks_needed, strict=True)
    table = torch.tensor([block_ids[:k] + [0] * (width - k) for (block_ids, _, _), k in rows], dtype=torch.long)
    query_start = torch.cumsum(query, 0) - query
    num_tokens = int(query.sum())
    seq_of_token = torch.repeat_interleave(torch.arange(n), query)
    position = context[seq_of_token] + torch.arange(num_tokens) - query_start[seq_of_token]
    slot_mapping = table[seq_of_token, position // block_size] * block_size + position % block_size

    is_decode = (query == 1) & (context > 0)
    fresh = _groups_by_length(torch.nonzero((context == 0) & (query > 1) & (query <= GROUP_MAX_LEN)), query)
    continued = _groups_by_length(torch.nonzero((context > 0) & ~is_decode & (total <= GROUP_MAX_LEN)), total)
    groups = [_prefill_group(members, query, query_start, device) for members in fresh]
    context_groups = [_context_group(members, context, query, query_start, num_blocks, table, block_size, device)
                      for members in continued]
    grouped = {i for members in fresh + continued for i in members}
    prefills = []
    for i in torch.nonzero(~is_decode).flatten().tolist():
        if i in grouped:
            continue
        ctx, q, tot = int(context[i]), int(query[i]), int(total[i])
        mask = None
        if ctx > 0:
            # Query j sits at absolute position ctx + j and sees keys 0..ctx + j.
            mask = torch.arange(tot).unsqueeze(0) <= torch.arange(ctx, tot).unsqueeze(1)
            mask = mask.to(device)
        prefills.append(PrefillSeq(int(query_start[i]), q, tot, table[i, : int(num_blocks[i])].to(device), mask))
    decodes = None
    decode_rows = torch.nonzero(is_decode).flatten()
    if decode_rows.numel():
        dec_width = int(num_blocks[decode_rows].max())
        decodes = DecodeBatch(query_start[decode_rows].to(device), table[decode_rows, :dec_width].to(device),
                              decode_key_mask(total[decode_rows], dec_width * block_size).to(device),
                              total[decode_rows].to(device))
    return AttentionMetadata(kv_caches, slot_mapping.to(device), prefills, decodes, num_tokens, groups,
                             context_groups, decode_kernel)


def _groups_by_length(rows: torch.Tensor, lengths: torch.Tensor) -> list[list[int]]:
    """`rows` bucketed by their `lengths` (powers of two, at least 16): the buckets of two or more."""
    buckets: dict[int, list[int]] = {}
    for i in rows.flatten().tolist():
        buckets.setdefault(max(16, 1 << (int(lengths[i]) - 1).bit_length()), []).append(i)
    return [members for members in buckets.values() if len(members) > 1]


def _padded_queries(members: list[int], query: torch.Tensor, query_start: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The members' new tokens padded to the longest one's: per [n, L] position, the step of its prompt it
    holds (padding repeats the last), whether it is real, and its packed-batch position."""
    lengths = query[members]
    steps = torch.arange(int(lengths.max())).unsqueeze(0)
    last = torch.minimum(steps, lengths.unsqueeze(1) - 1)
    return last, steps < lengths.unsqueeze(1), query_start[members].unsqueeze(1) + last


def _prefill_group(members: list[int], query: torch.Tensor, query_start: torch.Tensor,
                   device: torch.device) -> PaddedGroup:
    _, valid, index = _padded_queries(members, query, query_start)  # [n, L]
    return PaddedGroup(index.to(device), None, _real_rows(valid, device), index[valid].to(device))


def _context_group(members: list[int], context: torch.Tensor, query: torch.Tensor, query_start: torch.Tensor,
                   num_blocks: torch.Tensor, table: torch.Tensor, block_size: int,
                   device: torch.device) -> PaddedGroup:
    last, valid, index = _padded_queries(members, query, query_start)  # [n, Lq]
    blocks = table[members, : int(num_blocks[members].max())]
    keys = torch.arange(blocks.shape[1] * block_size)
    # Query j of a prompt sits at absolute position context + j and sees keys 0..context + j, all its own.
    mask = keys.view(1, 1, -1) <= (context[members].unsqueeze(1) + last).unsqueeze(2)  # [n, Lq, Lk]
    return PaddedGroup(index.to(device), mask.unsqueeze(1).to(device), _real_rows(valid, device),
                       index[valid].to(device), blocks.to(device))


def _real_rows(valid: torch.Tensor, device: torch.device) -> torch.Tensor:
    return torch.nonzero(valid.flatten()).flatten().to(device)


def paged_attention(
    module: HFModule,
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
    k_cache, v_cache = meta.kv_caches[module.layer_idx]
    kv_heads, dim = k_cache.shape[2], k_cache.shape[3]
    k_cache.view(-1, kv_heads, dim).index_copy_(0, meta.slot_mapping, key[0].transpose(0, 1).to(k_cache.dtype))
    v_cache.view(-1, kv_heads, dim).index_copy_(0, meta.slot_mapping, value[0].transpose(0, 1).to(v_cache.dtype))

    q = query[0]  # [heads, T, dim]
    heads = q.shape[0]
    # Gathers and scatters go by token, over [T, heads, dim] views (the projections' own layout, before HF's
    # transpose): whole rows of heads * dim copied by index_select, where indexing dimension 1 of [heads, T,
    # dim] copied element by element, and SDPA's flash kernel runs faster on queries and keys laid out by token
    # (bench/engine.py).
    q_by_token, k_by_token, v_by_token = q.transpose(0, 1), key[0].transpose(0, 1), value[0].transpose(0, 1)
    out = torch.empty((q.shape[1], heads, q.shape[2]), dtype=query.dtype, device=query.device)
    gqa = heads != kv_heads
    for group in (*meta.prefill_groups, *meta.context_groups):
        n, width = group.index.shape
        flat = group.index.flatten()
        q_grp = q_by_token.index_select(0, flat).view(n, width, heads, dim).transpose(1, 2)  # [n, heads, Lq, dim]
        if group.blocks is None:  # no context: the keys are the prompts' new ones, laid out like the queries
            k_grp = k_by_token.index_select(0, flat).view(n, width, kv_heads, dim).transpose(1, 2)
            v_grp = v_by_token.index_select(0, flat).view(n, width, kv_heads, dim).transpose(1, 2)
        else:
            flat = group.blocks.flatten()
            k_grp = k_cache.index_select(0, flat).view(n, -1, kv_heads, dim).transpose(1, 2)  # [n, kv, Lk, dim]
            v_grp = v_cache.index_select(0, flat).view(n, -1, kv_heads, dim).transpose(1, 2)
        o = F.scaled_dot_product_attention(q_grp, k_grp, v_grp, attn_mask=group.mask,
                                           is_causal=group.mask is None, scale=scaling, enable_gqa=gqa)
        rows = o.transpose(1, 2).reshape(n * width, heads, dim).index_select(0, group.valid)
        out.index_copy_(0, group.rows, rows)
    for seq in meta.prefills:
        q_seq = q[:, seq.query_start : seq.query_start + seq.query_len]
        # Whole blocks are gathered (one index per block, not per token), then cut to the sequence's length.
        k_seq = k_cache.index_select(0, seq.blocks).view(-1, kv_heads, dim)[: seq.total_len].transpose(0, 1)
        v_seq = v_cache.index_select(0, seq.blocks).view(-1, kv_heads, dim)[: seq.total_len].transpose(0, 1)
        o = F.scaled_dot_product_attention(q_seq, k_seq, v_seq, attn_mask=seq.mask, is_causal=seq.mask is None,
                                           scale=scaling, enable_gqa=gqa)
        out[seq.query_start : seq.query_start + seq.query_len] = o.transpose(0, 1)
    if meta.decodes is not None and meta.decode_kernel is not None:
        d = meta.decodes
        q_dec = q_by_token.index_select(0, d.query_index)  # [B, heads, dim]
        scale = scaling if scaling is not None else dim**-0.5
        decoded = meta.decode_kernel(q_dec, k_cache, v_cache, d.blocks, d.seq_lens, scale)
        out.index_copy_(0, d.query_index, decoded.to(out.dtype))
    elif meta.decodes is not None:
        d = meta.decodes
        q_dec = q_by_token.index_select(0, d.query_index)  # [B, heads, dim]
        decoded = gathered_decode_attention(q_dec, k_cache, v_cache, d.blocks, d.mask, scaling)
        out.index_copy_(0, d.query_index, decoded.to(out.dtype))
    return out.unsqueeze(0), None


def decode_key_mask(seq_lens: torch.Tensor, num_keys: int) -> torch.Tensor:
    """[B, 1, 1, num_keys] bool: which of the gathered key slots of each decode sequence are real."""
    return (torch.arange(num_keys).unsqueeze(0) < seq_lens.unsqueeze(1))[:, None, None, :]


def gathered_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, blocks: torch.Tensor,
                              key_mask: torch.Tensor, scale: float | None) -> torch.Tensor:
    """Decode attention by torch: each sequence's blocks gathered from the pool into one padded batch, then one
    SDPA call. q [B, heads, dim]; blocks [B, W] block tables; key_mask from `decode_key_mask` (W * block_size
    keys). Returns [B, heads, dim]. The C++ kernel (cpu_kernels.py) reads the pool in place instead."""
    batch, kv_heads, dim = blocks.shape[0], k_cache.shape[2], k_cache.shape[3]
    # index_select, not advanced indexing: a plain row copy per block, several times faster on CPU.
    flat = blocks.flatten()
    k = k_cache.index_select(0, flat).view(batch, -1, kv_heads, dim).transpose(1, 2)  # [B, kv, L, dim]
    v = v_cache.index_select(0, flat).view(batch, -1, kv_heads, dim).transpose(1, 2)
    out = F.scaled_dot_product_attention(q.unsqueeze(2), k, v, attn_mask=key_mask, scale=scale,
                                         enable_gqa=q.shape[1] != kv_heads)
    return out.squeeze(2)


AttentionInterface.register(ATTN_IMPLEMENTATION, paged_attention)
