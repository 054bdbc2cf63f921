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
    captures: tuple = ()  # (req_id, rows [k], positions [k]): rows of this step's query tensor to keep
    finishing: tuple = ()  # (req_id, prompt_tokens): prompts completed by this step


@dataclass
class Record:
    """A compressed request."""

    prompt_tokens: int
    dead_blocks: int
    slots_per_layer: list[int]
    settings: Settings
    freed_ids: frozenset = frozenset()  # ids of the blocks it gave back (what the worker last saw there)


@dataclass
class WorkerState:
    settings: Settings  # the engine's
    block_size: int
    num_layers: int
    runner: object = None  # the model runner (its requests and input batch)
    bias: Tensor | None = None  # [num_slots, L * H_kv] float32
    layer_index: Tensor = field(default_factory=lambda: torch.zeros((), dtype=torch.long))
    records: dict = field(default_factory=dict)  # req_id -> Record
    queries: dict = field(default_factory=dict)  # (req_id, layer) -> [(positions [k], queries [k, Hq, D])]
    chosen: dict = field(default_factory=dict)  # req_id -> (Settings, Pipeline) while its prompt is prefilled
    scheduled: dict | None = None  # req_id -> tokens scheduled in the step being run
    plan: StepPlan | None = None
    history: list = field(default_factory=list)  # (req_id, Record, seconds, valid slots, trimmed) per compression
    max_batch: int = 0  # most requests in one step's batch (concurrency)
    reused: set = field(default_factory=set)  # freed block ids seen in another request's live blocks
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
    def _forget(self, req_id: str) -> None:
        self.records.pop(req_id, None)
        self.chosen.pop(req_id, None)
        for key in [k for k in self.queries if k[0] == req_id]:
            del self.queries[key]

    def begin_step(self, scheduler_output) -> None:
        self.scheduled = dict(scheduler_output.num_scheduled_tokens)
        self.plan = None
        for req_id in scheduler_output.finished_req_ids:
            self._forget(req_id)
        # a request preempted and resumed recomputes its prompt: it will be compressed again
        cached = scheduler_output.scheduled_cached_reqs
        for req_id, resumed in zip(cached.req_ids, _resumed_flags(cached)):
            if resumed:
                self._forget(req_id)
        for new in scheduler_output.scheduled_new_reqs:
            self._forget(new.req_id)

    def plan_step(self, num_reqs: int) -> StepPlan:
        """Rows of this step's batch: dead blocks per row, query rows to keep, prompts finishing.
        Computed once per step (the first metadata build), after the runner updated its batch.
        The query rows kept are those of the positions the pipeline asks for (the last
        ``query_window`` prompt positions, the ``reference_queries`` strided ones), from every
        step of a chunked prefill."""
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
                if done < P:
                    if req_id not in self.chosen:  # decided once per prompt (warnings once too)
                        settings = self.request_settings(req)
                        self.chosen[req_id] = (settings, self.pipeline(settings))
                    settings, pipeline = self.chosen[req_id]
                    if pipeline is not None and P >= 2:
                        wanted = wanted_positions(P, pipeline.needs)
                        here = wanted[(wanted >= done) & (wanted < min(P, done + n))]
                        if here.numel():
                            captures.append((req_id, start + (here - done), here))
                        if P <= done + n:
                            finishing.append((req_id, P, settings))
            start += n
        self._note_reuse(req_ids)
        self.plan = StepPlan(dead_blocks=dead if bool((dead > 0).any()) else None,
                             captures=tuple(captures), finishing=tuple(finishing))
        return self.plan

    def _note_reuse(self, req_ids) -> None:
        """Evidence that freed blocks really went back to the pool: a block a running compressed
        request gave up that now holds another running request's tokens (the worker never
        learns of the freeing itself; its block tables keep the old ids)."""
        freed = [self.records[r].freed_ids for r in req_ids if r in self.records and self.records[r].freed_ids]
        if not freed:
            return
        live = set()
        for r in req_ids:
            req = self.runner.requests.get(r)
            if req is not None:
                rec = self.records.get(r)
                live.update(req.block_ids[0][rec.dead_blocks if rec is not None else 0:])
        for ids in freed:
            self.reused |= ids & live

    def capture_queries(self, layer_idx: int, query: Tensor, captures) -> None:
        """Keep this step's query rows [rows, Hq, D] of the positions each capture names."""
        for req_id, rows, positions in captures:
            kept = query[rows.to(query.device)].detach().clone()
            self.queries.setdefault((req_id, layer_idx), []).append((positions, kept))

    def queries_at(self, req_id: str, layer_idx: int, positions: Tensor) -> Tensor | None:
        """[len(positions), Hq, D]: the kept queries of ``positions`` (None if none were kept)."""
        parts = self.queries.get((req_id, layer_idx))
        if not parts:
            return None
        have = torch.cat([p for p, _ in parts])
        rows = torch.cat([q for _, q in parts])
        index = torch.full((int(max(int(have.max()), int(positions.max())) + 1),), -1, dtype=torch.long)
        index[have] = torch.arange(have.numel())
        picked = index[positions]
        if bool((picked < 0).any()):
            return None
        return rows[picked.to(rows.device)]

    def finished(self, req_id: str) -> None:
        """The prompt is compressed: its kept queries and its setting are no longer needed."""
        self.chosen.pop(req_id, None)
        for key in [k for k in self.queries if k[0] == req_id]:
            del self.queries[key]

    def end_step(self) -> None:
        self.scheduled = None
        self.plan = None


def wanted_positions(prompt_tokens: int, needs) -> Tensor:
    """[K] long, sorted, unique: the prompt positions whose queries a pipeline reads."""
    parts = [window_positions(prompt_tokens, needs.query_window), reference_positions(prompt_tokens, needs.reference_queries)]
    return torch.unique(torch.cat(parts))


def window_positions(prompt_tokens: int, window: int) -> Tensor:
    """The last ``window`` positions of the prompt (all of them when it is shorter)."""
    return torch.arange(max(0, prompt_tokens - window), prompt_tokens) if window > 0 else torch.zeros(0, dtype=torch.long)


def reference_positions(prompt_tokens: int, count: int) -> Tensor:
    """``count`` positions strided evenly over the prompt, the last one included (repeats when
    the prompt is shorter): the transformers path's rule (``kvcompress.hf.attention.strided_queries``)."""
    if count <= 0:
        return torch.zeros(0, dtype=torch.long)
    frac = torch.linspace(0.0, 1.0, count, dtype=torch.float64) if count > 1 else torch.ones(1, dtype=torch.float64)
    return torch.round(frac * (max(prompt_tokens, 1) - 1)).long().clamp(0, prompt_tokens - 1)


def _resumed_flags(cached):
    return [rid in cached.resumed_req_ids for rid in cached.req_ids]


__all__ = ["WorkerState", "StepPlan", "Record", "current", "install"]
