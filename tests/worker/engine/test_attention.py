"""worker/engine/attention.py: fresh prompts grouped into padded SDPA calls attend exactly as one call per
prompt does."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.worker.engine.test_engine import make_requests
from worker.engine import attention
from worker.engine.attention import build_metadata, paged_attention
from worker.engine.config import EngineConfig
from worker.engine.engine import Engine
from worker.model_loader import load_model


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
    assert group.valid.tolist() == [True] * 3 + [False] * 2 + [True] * 5
    assert group.rows.tolist() == list(range(8))
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


def test_engine_tokens_equal_with_and_without_grouping(tiny_llava_path: object,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    requests = make_requests(24, seed=11)
    default = attention.GROUP_MAX_LEN
    results = {}
    for limit in (default, 0):
        monkeypatch.setattr(attention, "GROUP_MAX_LEN", limit)
        engine = Engine(load_model(str(tiny_llava_path)), EngineConfig(num_kv_blocks=256, max_num_seqs=12))
        results[limit] = {r.request_id: r.token_ids for r in engine.generate(requests)}
    assert default > 0 and results[default] == results[0]
