"""worker/engine/attention.py: prompts grouped into padded SDPA calls (fresh ones, and those continuing a
cached context) attend exactly as one call per prompt does."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.worker.engine.test_engine import make_requests
from worker.engine import attention
from worker.engine.attention import build_metadata, paged_attention
from worker.engine.core.config import EngineConfig
from worker.engine.engine import Engine
from worker.inference.model_loader import load_model


class _Layer(torch.nn.Module):
    layer_idx = 0


def test_fresh_prompts_are_grouped_by_length() -> None:
    block = 4
    caches = [(torch.zeros(64, block, 2, 8), torch.zeros(64, block, 2, 8))]
    # (blocks, context, new tokens): two short fresh prompts, one alone in its bucket, one too long to
    # group, one continuing a context, one decode.
    seqs = [([0], 0, 3), ([1, 2], 0, 5), ([3, 4, 5, 6, 7, 8], 0, 20), (list(range(9, 9 + 75)), 0, 300),
            ([40, 41], 4, 3), ([42, 43], 6, 1)]
    meta = build_metadata(caches, block, seqs, torch.device("cpu"))
    assert len(meta.prefill_groups) == 1
    group = meta.prefill_groups[0]
    assert group.index.tolist() == [[0, 1, 2, 2, 2], [3, 4, 5, 6, 7]]
    assert group.valid.tolist() == [0, 1, 2, 5, 6, 7, 8, 9]
    assert group.rows.tolist() == list(range(8))
    assert group.mask is None  # padding follows each prompt's real tokens: SDPA's causal path suffices
    assert [p.query_len for p in meta.prefills] == [20, 300, 3]  # alone, too long, with context
    assert meta.decodes is not None and meta.decodes.seq_lens.tolist() == [7]


def test_grouped_attention_equals_one_call_per_prompt() -> None:
    torch.manual_seed(0)
    heads, kv_heads, dim, block = 4, 2, 8, 4
    lengths = [2, 7, 5, 16, 9]
    seqs, start = [], 0
    for n in lengths:
        blocks = list(range(start, start + -(-n // block)))
        seqs.append((blocks, 0, n))
        start += len(blocks)
    total = sum(lengths)
    q = torch.randn(1, heads, total, dim)
    k, v = torch.randn(1, kv_heads, total, dim), torch.randn(1, kv_heads, total, dim)
    caches = [(torch.zeros(start, block, kv_heads, dim), torch.zeros(start, block, kv_heads, dim))]
    meta = build_metadata(caches, block, seqs, torch.device("cpu"))
    assert len(meta.prefill_groups) == 1 and not meta.prefills
    got, _ = paged_attention(_Layer(), q, k, v, None, attn_metadata=meta)
    offset = 0
    for n in lengths:
        want = F.scaled_dot_product_attention(q[:, :, offset:offset + n], k[:, :, offset:offset + n],
                                              v[:, :, offset:offset + n], is_causal=True, enable_gqa=True)
        torch.testing.assert_close(got[0, offset:offset + n], want[0].transpose(0, 1), atol=1e-5, rtol=1e-5)
        offset += n


def test_prompts_continuing_a_context_are_grouped_by_total_length() -> None:
    block = 4
    caches = [(torch.zeros(64, block, 2, 8), torch.zeros(64, block, 2, 8))]
    # Two continuing a context with totals in the same bucket (8 and 14 -> 16), one alone in its bucket
    # (total 20 -> 32), one too long, one fresh prompt alone.
    seqs = [([0, 1], 5, 3), ([2, 3, 4, 5], 8, 6), ([6, 7, 8, 9, 10], 12, 8), (list(range(11, 11 + 70)), 270, 10),
            ([20], 0, 2)]
    meta = build_metadata(caches, block, seqs, torch.device("cpu"))
    assert len(meta.context_groups) == 1 and not meta.prefill_groups
    group = meta.context_groups[0]
    assert group.blocks is not None and group.mask is not None
    assert group.index.tolist() == [[0, 1, 2, 2, 2, 2], [3, 4, 5, 6, 7, 8]]
    assert group.blocks.tolist() == [[0, 1, 0, 0], [2, 3, 4, 5]]
    assert group.valid.tolist() == [0, 1, 2, 6, 7, 8, 9, 10, 11]
    assert group.rows.tolist() == list(range(9))
    # The first prompt's query 0 sits at position 5: keys 0..5; its padding repeats its last query (keys 0..7).
    assert group.mask[0, 0, 0].nonzero().flatten().tolist() == list(range(6))
    assert group.mask[0, 0, 5].nonzero().flatten().tolist() == list(range(8))
    assert group.mask[1, 0, 5].nonzero().flatten().tolist() == list(range(14))
    assert [(p.query_len, p.total_len) for p in meta.prefills] == [(8, 20), (10, 280), (2, 2)]


def test_grouped_context_attention_equals_one_call_per_prompt(monkeypatch: pytest.MonkeyPatch) -> None:
    torch.manual_seed(1)
    heads, kv_heads, dim, block = 4, 2, 8, 4
    spans = [(5, 3), (8, 6), (12, 2), (9, 7)]  # (cached context, new tokens)
    seqs, start = [], 0
    for ctx, new in spans:
        blocks = list(range(start, start + -(-(ctx + new) // block)))
        seqs.append((blocks, ctx, new))
        start += len(blocks)
    total = sum(new for _, new in spans)
    q = torch.randn(1, heads, total, dim)
    k, v = torch.randn(1, kv_heads, total, dim), torch.randn(1, kv_heads, total, dim)
    pool = (torch.randn(start, block, kv_heads, dim), torch.randn(start, block, kv_heads, dim))
    outputs = {}
    for limit in (attention.GROUP_MAX_LEN, 0):
        monkeypatch.setattr(attention, "GROUP_MAX_LEN", limit)
        caches = [(pool[0].clone(), pool[1].clone())]
        meta = build_metadata(caches, block, seqs, torch.device("cpu"))
        assert (len(meta.context_groups), len(meta.prefills)) == ((1, 0) if limit else (0, 4))
        outputs[limit], _ = paged_attention(_Layer(), q, k, v, None, attn_metadata=meta)
    torch.testing.assert_close(outputs[attention.GROUP_MAX_LEN], outputs[0], atol=1e-5, rtol=1e-5)


def test_engine_tokens_equal_with_and_without_grouping(tiny_llava_path: object,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """With a system prompt shared by every request, all but the first continue its cached blocks: grouped
    or not, the same tokens."""
    requests = make_requests(24, seed=11, system=True)
    default = attention.GROUP_MAX_LEN
    results = {}
    built: list[attention.AttentionMetadata] = []

    def recording(*args: object, **kwargs: object) -> attention.AttentionMetadata:
        built.append(build(*args, **kwargs))  # type: ignore[arg-type]
        return built[-1]

    build = attention.build_metadata
    monkeypatch.setattr("worker.engine.model_runner.build_metadata", recording)
    for limit in (default, 0):
        monkeypatch.setattr(attention, "GROUP_MAX_LEN", limit)
        built.clear()
        engine = Engine(load_model(str(tiny_llava_path)), EngineConfig(num_kv_blocks=256, max_num_seqs=12))
        results[limit] = {r.request_id: r.token_ids for r in engine.generate(requests)}
        grouped = sum(len(m.context_groups) + len(m.prefill_groups) for m in built)
        assert (grouped > 0) == (limit > 0)
        if limit:
            assert any(m.context_groups for m in built)
    assert default > 0 and results[default] == results[0]
