"""FlexAttention for vLLM with kvcompress's per-slot bias, and the KV-cache spec/manager pair
that returns a compressed prompt's leading blocks to the pool.

Registered by ``kvcompress.vllm.plugin.register`` (the ``vllm.general_plugins`` entry point) in
every vLLM process:

- ``KVCompressFlexBackend`` replaces the CPU_ATTN backend (CPU) or FLEX_ATTENTION (CUDA). It is
  vLLM's FlexAttention backend plus (a) a ``score_mod`` adding ``bias[physical slot, layer, kv
  head]`` (the slot's log-size; -inf for a slot that holds nothing), (b) the dead leading blocks
  of compressed prompts dropped from each request's block table before the block mask is built
  (so they are never read and the kernel skips them), and (c) on CPU the three fixes the stock
  backend needs there: a cache write by plain indexing (``reshape_and_cache_flash`` is CUDA-only),
  the block-mask index table padded to cover the whole cache, and empty "full block" tables.
- ``CompressedAttentionSpec`` (a FullAttentionSpec carrying the engine's block rule) is what the
  backend's ``customize_spec`` gives every layer, and ``CompressedAttentionManager`` is its
  manager: once a request's prompt is processed, its leading ``BlockRule.freed(P)`` blocks go back
  to the pool through ``remove_skipped_blocks`` (replaced by the null block, positions kept).
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

import torch
from torch.nn.attention.flex_attention import BlockMask
from vllm.platforms import current_platform
from vllm.utils.math_utils import cdiv
from vllm.v1.attention.backends.flex_attention import (
    FlexAttentionBackend,
    FlexAttentionImpl,
    FlexAttentionMetadata,
    FlexAttentionMetadataBuilder,
)
from vllm.v1.core.single_type_kv_cache_manager import FullAttentionManager
from vllm.v1.kv_cache_interface import FullAttentionSpec
from vllm.v1.kv_cache_spec_registry import register_kv_cache_spec

from . import runtime
from .settings import BlockRule, Settings


# ---------------------------------------------------------------------------- scheduler side
class CompressedAttentionManager(FullAttentionManager):
    """Full attention whose requests give back the leading blocks of their compressed prompt.

    The compression runs in the worker in the step that finishes the prompt; ``processed``
    (committed tokens, in-flight steps excluded) reaching the prompt length means it has run."""

    def remove_skipped_blocks(self, request_id: str, processed_computed_tokens: int,
                              num_prompt_tokens: int | None = None) -> None:
        rule = self._kvc_rule()
        if not rule.frees or num_prompt_tokens is None or processed_computed_tokens < num_prompt_tokens:
            return
        dead = rule.freed(num_prompt_tokens, self.block_size)
        if dead > 0:
            self._remove_blocks_in_range(request_id, 0, dead)

    def _kvc_rule(self) -> BlockRule:
        rule = self.__dict__.get("_kvc_block_rule")
        if rule is None:  # built once: the spec is fixed for the engine's life
            spec = self.kv_cache_spec
            rule = BlockRule.of(spec.kvc_settings()) if isinstance(spec, CompressedAttentionSpec) else BlockRule()
            self._kvc_block_rule = rule
        return rule


@register_kv_cache_spec(manager_class=CompressedAttentionManager, uniform_type_base_spec=FullAttentionSpec)
@dataclass(frozen=True, kw_only=True)
class CompressedAttentionSpec(FullAttentionSpec):
    """FullAttentionSpec plus the engine's compression setting (the scheduler's block rule)."""

    kvc_preset: str | None = None
    kvc_budget: float | int | None = None
    kvc_overrides: str = "{}"  # JSON, so the spec stays hashable
    kvc_free_blocks: bool = False

    def kvc_settings(self) -> Settings:
        import json

        return Settings(preset=self.kvc_preset, budget=self.kvc_budget, free_blocks=self.kvc_free_blocks,
                        overrides=json.loads(self.kvc_overrides))

    @classmethod
    def merge(cls, specs: list) -> "CompressedAttentionSpec":
        # FullAttentionSpec.merge rebuilds the spec from its own fields only: carry ours over
        # (every layer of a group has the same engine setting)
        ours = {f: getattr(specs[0], f) for f in ("kvc_preset", "kvc_budget", "kvc_overrides", "kvc_free_blocks")}
        for spec in specs[1:]:
            if any(getattr(spec, f) != v for f, v in ours.items()):
                raise ValueError("layers of one KV-cache group carry different kvcompress settings")
        return replace(super().merge(specs), **ours)

    @classmethod
    def wrap(cls, spec: FullAttentionSpec, settings: Settings) -> "CompressedAttentionSpec":
        import json

        base = {f.name: getattr(spec, f.name) for f in fields(spec) if f.init}
        return cls(**base, kvc_preset=settings.preset, kvc_budget=settings.budget,
                   kvc_overrides=json.dumps(dict(settings.overrides), sort_keys=True),
                   kvc_free_blocks=settings.free_blocks and settings.enabled)


# ---------------------------------------------------------------------------- metadata
@dataclass
class KVCompressMetadata(FlexAttentionMetadata):
    """FlexAttentionMetadata whose score_mod adds the per-slot bias of the current layer."""

    kvc_bias: torch.Tensor | None = None  # [num_slots, L * H_kv] float32 (runtime.bias)
    kvc_layer: torch.Tensor | None = None  # 0-d long, set by each layer before its kernel call
    kvc_group: int = 1  # query heads per KV head
    kvc_num_kv_heads: int = 1
    kvc_captures: tuple = ()  # (req_id, start, stop) query rows to keep for the query window
    kvc_pad_cache: bool = False

    def get_transformed_score_mod(self):
        bias = self.kvc_bias
        if bias is None:
            return None
        layer, group, hkv = self.kvc_layer, self.kvc_group, self.kvc_num_kv_heads

        # the block mask already limits kv_idx to live slots of the query's own request; the
        # bias is read by PHYSICAL slot, so no logical conversion is needed here
        def bias_score_mod(score, b, h, q_idx, kv_idx):
            return score + bias[kv_idx, layer * hkv + h // group]

        return bias_score_mod

    def _build_block_mask_direct(self) -> BlockMask:
        mask = super()._build_block_mask_direct()
        if not self.kvc_pad_cache:
            return mask
        # torch's CPU flex kernel wants the index table to span every block of the cache and
        # the "full block" tables to exist (empty here: every block goes through mask_mod).
        # The table is made exactly that wide: vLLM's width follows the batch's longest sequence,
        # and every new width would compile the flex kernel again. Its rows are left-packed
        # unique block ids (at most `total` of them, counted by kv_num), so cutting is safe.
        kv_num, kv_idx = mask.kv_num_blocks, mask.kv_indices
        total = self.num_blocks
        if kv_idx.shape[-1] < total:
            pad = torch.zeros(*kv_idx.shape[:-1], total - kv_idx.shape[-1], dtype=kv_idx.dtype, device=kv_idx.device)
            kv_idx = torch.cat([kv_idx.clamp(min=0), pad], dim=-1)
        else:
            kv_idx = kv_idx[..., :total].clamp(min=0)
        kwargs = dict(
            seq_lengths=(self.num_actual_tokens, self.total_cache_tokens),
            full_kv_num_blocks=torch.zeros_like(kv_num), full_kv_indices=torch.zeros_like(kv_idx),
            BLOCK_SIZE=(self.q_block_size, self.kv_block_size), mask_mod=self.mask_mod,
        )
        try:
            return BlockMask.from_kv_blocks(kv_num, kv_idx, compute_q_blocks=False, **kwargs)
        except TypeError:  # torch without compute_q_blocks
            return BlockMask.from_kv_blocks(kv_num, kv_idx, **kwargs)


class KVCompressMetadataBuilder(FlexAttentionMetadataBuilder):
    def __init__(self, kv_cache_spec, layer_names, vllm_config, device):
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        model = vllm_config.model_config
        parallel = vllm_config.parallel_config
        self.kvc_num_kv_heads = model.get_num_kv_heads(parallel)
        self.kvc_group = model.get_num_attention_heads(parallel) // self.kvc_num_kv_heads
        self.kvc_num_layers = model.get_num_layers(parallel)

    def build(self, common_prefix_len, common_attn_metadata, fast_build: bool = False):
        state = runtime.current()
        plan = None
        if state is not None:
            num_slots = self.cache_config.num_gpu_blocks * self.kv_cache_spec.block_size
            state.ensure_bias(num_slots, self.kvc_num_layers * self.kvc_num_kv_heads, self.device)
            plan = state.plan_step(common_attn_metadata.num_reqs)
            if plan.dead_blocks is not None:
                # blocks a compressed prompt gave up hold nothing of this request any more (they
                # may already belong to another one): block id 0 is never attended
                table = common_attn_metadata.block_table_tensor.clone()
                width = table.shape[1]
                cols = torch.arange(width, device=table.device)[None, :]
                dead = plan.dead_blocks.to(table.device)[:, None]
                table[: dead.shape[0]] = table[: dead.shape[0]].masked_fill(cols < dead, 0)
                common_attn_metadata = replace(common_attn_metadata, block_table_tensor=table)
        base = super().build(common_prefix_len, common_attn_metadata, fast_build)
        values = {f.name: getattr(base, f.name) for f in fields(FlexAttentionMetadata) if f.init}
        values.pop("block_mask", None)
        values.pop("transformed_score_mod", None)
        extra = dict(kvc_group=self.kvc_group, kvc_num_kv_heads=self.kvc_num_kv_heads,
                     kvc_pad_cache=current_platform.is_cpu())
        if state is not None:
            extra.update(kvc_bias=state.bias, kvc_layer=state.layer_index,
                         kvc_captures=plan.captures)
        meta = KVCompressMetadata(**values, **extra)
        meta.block_mask = meta._build_block_mask_direct() if meta.direct_build else meta.build_block_mask()
        return meta


class KVCompressFlexImpl(FlexAttentionImpl):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.kvc_layer_idx: int | None = None

    def _layer_idx(self, layer) -> int:
        if self.kvc_layer_idx is None:
            from vllm.model_executor.models.utils import extract_layer_index

            self.kvc_layer_idx = extract_layer_index(layer.layer_name)
        return self.kvc_layer_idx

    def do_kv_cache_update(self, layer, key, value, kv_cache, slot_mapping) -> None:
        if not current_platform.is_cpu():
            super().do_kv_cache_update(layer, key, value, kv_cache, slot_mapping)
        else:
            # plain indexing into the flattened cache; reshape_and_cache_flash is CUDA-only
            key_cache, value_cache = kv_cache.transpose(1, 2).split(self.head_size, dim=-1)
            n = slot_mapping.shape[0]
            key_cache.view(-1, self.num_kv_heads, self.head_size)[slot_mapping] = key[:n]
            value_cache.view(-1, self.num_kv_heads, self.head_size)[slot_mapping] = value[:n]
        state = runtime.current()
        if state is not None and state.bias is not None:
            # a freshly written slot is one token: bias 0 (its block may have held another
            # request's merged slots before)
            layer_idx = self._layer_idx(layer)
            hkv = self.num_kv_heads
            state.bias[slot_mapping, layer_idx * hkv: (layer_idx + 1) * hkv] = 0.0

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output, output_scale=None,
                output_block_scale=None):
        if isinstance(attn_metadata, KVCompressMetadata) and attn_metadata.kvc_layer is not None:
            layer_idx = self._layer_idx(layer)
            attn_metadata.kvc_layer.fill_(layer_idx)
            state = runtime.current()
            if state is not None and attn_metadata.kvc_captures:
                state.capture_queries(layer_idx, query, attn_metadata.kvc_captures)
        return super().forward(layer, query, key, value, kv_cache, attn_metadata, output,
                               output_scale=output_scale, output_block_scale=output_block_scale)


class KVCompressFlexBackend(FlexAttentionBackend):
    """vLLM's FlexAttention with kvcompress's per-slot bias (see the module docstring)."""

    @staticmethod
    def get_name() -> str:
        return "FLEX_ATTENTION"

    @staticmethod
    def get_impl_cls():
        return KVCompressFlexImpl

    @staticmethod
    def get_builder_cls():
        return KVCompressMetadataBuilder

    @classmethod
    def customize_spec(cls, spec):
        spec = super().customize_spec(spec)
        if type(spec) is FullAttentionSpec:
            # runs in the worker while the model runner lists its KV-cache specs, where vLLM's
            # current config is not set: the compressing worker's state holds the engine setting
            state = runtime.current()
            if state is not None:
                settings = state.settings
            else:
                from vllm.config import get_current_vllm_config_or_none

                config = get_current_vllm_config_or_none()
                settings = Settings.from_vllm_config(config) if config is not None else Settings.from_env()
            return CompressedAttentionSpec.wrap(spec, settings)
        return spec
