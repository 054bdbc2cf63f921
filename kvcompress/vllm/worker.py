"""vLLM workers that compress each request's prompt KV right after the step that finishes it.

    LLM(model, worker_cls="kvcompress.vllm.worker.CPUWorker", ...)   # CPU
    LLM(model, worker_cls="kvcompress.vllm.worker.GPUWorker", ...)   # CUDA

The step that completes a prompt runs with full attention (its first sampled token sees the whole
prompt, as in the transformers path); after its forward, every layer's prompt KV is read from the
paged cache, compressed by the pipeline and written back compacted to the end of the prompt's
range with its log-sizes as the attention bias (``kvcompress.vllm.compaction``). Decode steps then
attend over the compressed slots plus the new tokens; RoPE positions continue at the true length.
"""

from __future__ import annotations

import time

import torch

from . import runtime
from .compaction import PagedLayer, compress_prompt, prompt_slots
from .runtime import Record, WorkerState, logger, reference_positions, window_positions
from .settings import Settings


class _CompressingWorker:
    """Mixin for a vLLM worker class (CPU or GPU)."""

    def _kvc_setup(self) -> None:
        from .plugin import register_backend_override

        register_backend_override()  # the model is built after this: its layers get our backend
        cfg = self.vllm_config
        settings = Settings.from_vllm_config(cfg)
        if settings.enabled:
            settings.pipeline()  # unsupported pipelines fail at start, not in the engine loop
        num_layers = cfg.model_config.get_num_layers(cfg.parallel_config)
        self.kvc_state = WorkerState(settings=settings, block_size=cfg.cache_config.block_size, num_layers=num_layers)
        self.kvc_vocab = None
        self.kvc_layers: list | None = None
        runtime.install(self.kvc_state)

    # ------------------------------------------------------------------ helpers
    def _kvc_vocabulary(self):
        if self.kvc_vocab is None:
            from transformers import AutoTokenizer

            from ..hf.vocab import token_texts

            model_config = self.vllm_config.model_config
            tok = AutoTokenizer.from_pretrained(model_config.tokenizer, trust_remote_code=model_config.trust_remote_code)
            self.kvc_vocab = token_texts(tok)
        return self.kvc_vocab

    def _kvc_paged_layers(self) -> list:
        """(layer index, keys [S, H, D] view, values view) of every attention layer, in order."""
        if self.kvc_layers is None:
            from vllm.model_executor.models.utils import extract_layer_index

            ctx = self.model_runner.compilation_config.static_forward_context
            found = []
            for name, module in ctx.items():
                kv = getattr(module, "kv_cache", None)
                impl = getattr(module, "impl", None)
                if not isinstance(kv, torch.Tensor) or impl is None or not hasattr(impl, "head_size"):
                    continue
                k, v = kv.transpose(1, 2).split(impl.head_size, dim=-1)
                H, D = impl.num_kv_heads, impl.head_size
                found.append((extract_layer_index(name), k.view(-1, H, D), v.view(-1, H, D), H))
            found.sort(key=lambda t: t[0])
            self.kvc_layers = found
        return self.kvc_layers

    # ------------------------------------------------------------------ the step
    def _kvc_compress_finished(self) -> None:
        state = self.kvc_state
        plan = state.plan
        if plan is None or not plan.finishing:
            return
        runner = self.model_runner
        layers = self._kvc_paged_layers()
        bs = state.block_size
        for req_id, P, settings in plan.finishing:
            req = runner.requests[req_id]
            pipeline = state.pipeline(settings)
            start = time.perf_counter()
            device = layers[0][1].device
            slots = prompt_slots(req.block_ids[0], P, bs, device=device)
            paged = [PagedLayer(keys=k, values=v, bias=state.bias[:, idx * H:(idx + 1) * H]) for idx, k, v, H in layers]
            needs = pipeline.needs
            queries = self._kvc_queries(req_id, layers, window_positions(P, needs.query_window))
            reference = self._kvc_queries(req_id, layers, reference_positions(P, needs.reference_queries))
            ids = torch.as_tensor(req.prompt_token_ids[:P], dtype=torch.long, device=device)
            # the scheduler frees the blocks in front of the engine's budget whatever happens, so
            # every layer must fit it (compress_prompt cuts a layer the pipeline left above it)
            limit = state.rule.kept(P) if state.rule.frees else None
            # text-aware strategies read state.vocab; built once per worker
            result = compress_prompt(pipeline, paged, slots, bs, token_ids=ids, vocab=self._kvc_vocabulary(),
                                     queries=queries, reference=reference, max_slots=limit)
            if result.trimmed_layers:
                logger.warning("request %s: %s kept more than the %d slots the freed blocks leave in %d layers; "
                               "cut to the sinks and the most recent slots", req_id, pipeline.config.name, limit,
                               result.trimmed_layers)
            freed = state.rule.freed(P, bs) if state.rule.frees else 0  # what the scheduler gives back
            rec = Record(prompt_tokens=P, dead_blocks=result.dead_blocks, slots_per_layer=result.slots_per_layer,
                         settings=settings, freed_ids=frozenset(req.block_ids[0][:freed]))
            state.records[req_id] = rec
            state.history.append((req_id, rec, time.perf_counter() - start, result.valid_slots,
                                  result.trimmed_layers))
            state.finished(req_id)

    def _kvc_queries(self, req_id, layers, positions):
        """Per layer [len(positions), Hq, D] kept queries, or None when none are asked for."""
        if positions.numel() == 0:
            return None
        found = [self.kvc_state.queries_at(req_id, idx, positions) for idx, _, _, _ in layers]
        if any(q is None for q in found):
            raise RuntimeError(f"request {req_id}: queries of prompt positions were not kept "
                               "(a prefill step ran without the plugin's backend?)")
        return found

    def execute_model(self, scheduler_output):
        state = self.kvc_state
        state.runner = self.model_runner
        state.begin_step(scheduler_output)
        try:
            output = super().execute_model(scheduler_output)
            with torch.inference_mode():
                self._kvc_compress_finished()
        finally:
            state.end_step()
        return output

    def kvc_report(self) -> dict:
        """Every compression this worker ran (request, prompt tokens, slots per layer, seconds),
        the most requests one step ran, and how many freed blocks were seen holding another
        request's tokens (``llm.collective_rpc("kvc_report")`` returns it)."""
        state = self.kvc_state
        return {"max_batch": state.max_batch, "reused_freed_blocks": len(state.reused), "compressions": [{"request_id": rid, "prompt_tokens": rec.prompt_tokens, "dead_blocks": rec.dead_blocks,
                 "slots_per_layer": rec.slots_per_layer, "valid_slots_per_layer": valid, "seconds": sec,
                 "preset": rec.settings.preset, "budget": rec.settings.budget, "trimmed_layers": trimmed}
                for rid, rec, sec, valid, trimmed in state.history]}

    def shutdown(self) -> None:
        super().shutdown()
        from .plugin import unregister_backend_override

        if runtime.current() is self.kvc_state:
            runtime.install(None)
        unregister_backend_override()  # a later engine in this process is stock vLLM again


def _make(base):
    class Worker(_CompressingWorker, base):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self._kvc_setup()

    return Worker


def _cpu_base():
    from vllm.v1.worker.cpu_worker import CPUWorker as base

    return base


def _gpu_base():
    from vllm.v1.worker.gpu_worker import Worker as base

    return base


def __getattr__(name: str):
    # the base class is imported only for the worker asked for (the GPU one pulls CUDA code)
    if name == "CPUWorker":
        cls = _make(_cpu_base())
    elif name == "GPUWorker":
        cls = _make(_gpu_base())
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    cls.__name__ = cls.__qualname__ = name
    cls.__module__ = __name__
    globals()[name] = cls
    return cls
