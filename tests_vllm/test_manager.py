"""The block-freeing KV-cache manager against vLLM's own block pool (no engine, no model)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("vllm")

from vllm.v1.core.block_pool import BlockPool  # noqa: E402

from kvcompress.vllm.backend import CompressedAttentionManager, CompressedAttentionSpec  # noqa: E402
from kvcompress.vllm.settings import BlockRule, Settings  # noqa: E402

BS = 32


def _manager(settings: Settings, num_blocks: int = 200):
    base = dict(block_size=BS, num_kv_heads=3, head_size=64, dtype=torch.float32)
    spec = CompressedAttentionSpec(**base, kvc_preset=settings.preset, kvc_budget=settings.budget,
                                   kvc_free_blocks=settings.free_blocks and settings.enabled)
    pool = BlockPool(num_gpu_blocks=num_blocks, enable_caching=False, hash_block_size=BS)
    return CompressedAttentionManager(spec, pool, False, 0, BS), pool


@pytest.mark.parametrize("budget", [0.25, 0.5, 100])
def test_leading_blocks_return_to_the_pool_once_the_prompt_is_processed(budget):
    settings = Settings("semanticache", budget)
    manager, pool = _manager(settings)
    P = 2000
    manager.allocate_new_blocks("r", P + 1, P + 1)
    held = len(manager.req_to_blocks["r"])
    free = pool.get_num_free_blocks()
    manager.remove_skipped_blocks("r", P - 1, num_prompt_tokens=P)  # the prompt's last step still in flight
    assert pool.get_num_free_blocks() == free
    manager.remove_skipped_blocks("r", P, num_prompt_tokens=P)
    dead = BlockRule.of(settings).freed(P, BS)
    assert dead > 0 and pool.get_num_free_blocks() == free + dead
    blocks = manager.req_to_blocks["r"]
    assert len(blocks) == held  # positions kept: the freed blocks are replaced by the null block
    assert all(b.is_null for b in blocks[:dead]) and not any(b.is_null for b in blocks[dead:])
    manager.remove_skipped_blocks("r", P + 40, num_prompt_tokens=P)  # later steps free nothing more
    assert pool.get_num_free_blocks() == free + dead


@pytest.mark.parametrize("settings", [Settings("semanticache", 0.25, free_blocks=False), Settings(None, None),
                                      Settings("full", None)])
def test_nothing_is_freed_without_a_shrinking_budget(settings):
    manager, pool = _manager(settings)
    manager.allocate_new_blocks("r", 1000, 1000)
    free = pool.get_num_free_blocks()
    manager.remove_skipped_blocks("r", 1000, num_prompt_tokens=1000)
    assert pool.get_num_free_blocks() == free


def test_merging_layer_specs_keeps_the_setting():
    """vLLM merges the layers' specs of a KV-cache group with FullAttentionSpec.merge, which
    rebuilds the spec from its own fields: the engine setting must survive it (else the
    scheduler's manager sees no budget and frees nothing)."""
    base = dict(block_size=BS, num_kv_heads=3, head_size=64, dtype=torch.float32)
    spec = CompressedAttentionSpec(**base, kvc_preset="semanticache", kvc_budget=0.25, kvc_free_blocks=True)
    merged = CompressedAttentionSpec.merge([spec, spec])
    assert merged == spec and BlockRule.of(merged.kvc_settings()).frees
    with pytest.raises(ValueError, match="different kvcompress settings"):
        CompressedAttentionSpec.merge([spec, CompressedAttentionSpec(**base, kvc_preset="full")])
