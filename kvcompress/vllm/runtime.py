"""The worker process's compression state, shared by the worker and the attention backend.

One vLLM worker process serves one model runner; the worker (``kvcompress.vllm.worker``)
installs a ``WorkerState`` here when it starts, and the backend reads it while building each
step's metadata and running each layer. Without a worker of ours (plain vLLM), ``current()`` is
None and the backend is vLLM's FlexAttention with no bias.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch
from torch import Tensor

from .settings import BlockRule, Settings

logger = logging.getLogger("kvcompress.vllm")

_STATE: "WorkerState | None" = None


def current() -> "WorkerState | None":
    return _STATE


def install(state: "WorkerState | None") -> None:
    global _STATE
    _STATE = state


@dataclass
class StepPlan:
    dead_blocks: Tensor | None  # [num_reqs] long: leading blocks no longer attended, per batch row
    captures: tuple = ()  # (req_id, start, stop): rows of this step's query tensor to keep
    finishing: tuple = ()  # (req_id, prompt_tokens): prompts completed by this step


@dataclass
class Record:
    """A compressed request."""

    prompt_tokens: int
    dead_blocks: int
    slots_per_layer: list[int]
    settings: Settings


@dataclass
class WorkerState:
    settings: Settings  # the engine's
    block_size: int
    num_layers: int
    runner: object = None  # the model runner (its requests and input batch)
    bias: Tensor | None = None  # [num_slots, L * H_kv] float32
    layer_index: Tensor = field(default_factory=lambda: torch.zeros((), dtype=torch.long))
    records: dict = field(default_factory=dict)  # req_id -> Record
    queries: dict = field(default_factory=dict)  # (req_id, layer) -> [W, Hq, D]
    scheduled: dict | None = None  # req_id -> tokens scheduled in the step being run
    plan: StepPlan | None = None
    history: list = field(default_factory=list)  # (req_id, Record, seconds, valid slots, trimmed) per compression
    max_batch: int = 0  # most requests in one step's batch (concurrency)
    pipelines: dict = field(default_factory=dict)  # settings key -> Pipeline (built once)
    rule: BlockRule = field(init=False)  # the engine's block rule (what the scheduler frees)

    def __post_init__(self):
        self.rule = BlockRule.of(self.settings)

    def pipeline(self, settings: Settings):
        """The Pipeline of ``settings`` (None: no compression), built once per setting."""
        key = settings.key()
        if key not in self.pipelines:
            self.pipelines[key] = settings.pipeline()
        return self.pipelines[key]

    def ensure_bias(self, num_slots: int, columns: int, device) -> None:
        if self.bias is None or self.bias.shape != (num_slots, columns):
            self.bias = torch.zeros(num_slots, columns, dtype=torch.float32, device=device)
            self.layer_index = self.layer_index.to(device)

    # ------------------------------------------------------------------ per request
    def request_settings(self, req_state) -> Settings:
        """The engine setting, or the request's ``extra_args["kvcompress"]``, capped to what the
        scheduler's block rule leaves room for."""
        params = req_state.sampling_params  # None for pooling requests
        try:
            mine = Settings.from_extra_args(None if params is None else params.extra_args, self.settings)
            if mine is None:
                return self.settings
            self.pipeline(mine)  # an unsupported pipeline is refused here, not in the worker
        except ValueError as err:
            logger.warning("request %s: ignoring its kvcompress extra_args: %s", req_state.req_id, err)
            return self.settings
        if self.rule.frees:
            P = req_state.num_prompt_tokens
            mine_rule = BlockRule.of(Settings(mine.preset, mine.budget, True, mine.overrides))
            if not mine_rule.frees or mine_rule.kept(P) > self.rule.kept(P):
                logger.warning("request %s: budget %r keeps more slots than the engine budget %r leaves "
                               "room for once blocks are freed; using the engine setting",
                               req_state.req_id, mine.budget, self.settings.budget)
                return self.settings
        return mine

    # ------------------------------------------------------------------ one step
    def begin_step(self, scheduler_output) -> None:
        self.scheduled = dict(scheduler_output.num_scheduled_tokens)
        self.plan = None
        self.queries.clear()
        for req_id in scheduler_output.finished_req_ids:
            self.records.pop(req_id, None)
        # a request preempted and resumed recomputes its prompt: it will be compressed again
        cached = scheduler_output.scheduled_cached_reqs
        for req_id, resumed in zip(cached.req_ids, _resumed_flags(cached)):
            if resumed:
                self.records.pop(req_id, None)
        for new in scheduler_output.scheduled_new_reqs:
            self.records.pop(new.req_id, None)

    def plan_step(self, num_reqs: int) -> StepPlan:
        """Rows of this step's batch: dead blocks per row, query rows to keep, prompts finishing.
        Computed once per step (the first metadata build), after the runner updated its batch."""
        if self.plan is not None:
            return self.plan
        runner = self.runner
        if runner is None or self.scheduled is None:
            return StepPlan(dead_blocks=None)
        req_ids = list(runner.input_batch.req_ids[:num_reqs])
        self.max_batch = max(self.max_batch, num_reqs)
        dead = torch.zeros(num_reqs, dtype=torch.long)
        captures, finishing = [], []
        start = 0
        for row, req_id in enumerate(req_ids):
            n = self.scheduled.get(req_id, 0)
            rec = self.records.get(req_id)
            if rec is not None:
                dead[row] = rec.dead_blocks
            req = runner.requests.get(req_id)
            if req is not None and rec is None and n > 0:
                P = req.num_prompt_tokens
                done = req.num_computed_tokens
                if done < P <= done + n:
                    settings = self.request_settings(req)
                    pipeline = self.pipeline(settings)
                    if pipeline is not None and P >= 2:
                        finishing.append((req_id, P, settings))
                        window = pipeline.needs.query_window
                        if window > 0:
                            stop = start + (P - done)  # rows of positions < P
                            captures.append((req_id, max(start, stop - window), stop))
            start += n
        self.plan = StepPlan(dead_blocks=dead if bool((dead > 0).any()) else None,
                             captures=tuple(captures), finishing=tuple(finishing))
        return self.plan

    def capture_queries(self, layer_idx: int, query: Tensor, captures) -> None:
        for req_id, start, stop in captures:
            self.queries[(req_id, layer_idx)] = query[start:stop].detach().clone()

    def end_step(self) -> None:
        self.scheduled = None
        self.plan = None
        self.queries.clear()


def _resumed_flags(cached):
    return [rid in cached.resumed_req_ids for rid in cached.req_ids]


__all__ = ["WorkerState", "StepPlan", "Record", "current", "install"]
