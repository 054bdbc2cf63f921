"""The context-reconstruction pass (KVzip, arXiv 2505.23416): question-free importance per slot.

After the prefill, the model reads a "repeat the previous context" prompt followed by the cached
context itself (teacher forced) on top of the cached keys and values. The attention each cached
slot receives from those reconstruction queries says how much the model needs it to reproduce
the context, and so how much some later question may need it:

    score[l, b, h, n] = max over reconstruction queries t and query heads g of KV group h of
                        softmax_n'(q_t . k_n' * scale + bias_n')[n]

where the softmax runs over the cached slots AND the pass's own tokens (causally), as in a real
forward. The pass is run in chunks: each chunk is the repeat prompt plus ``chunk`` context tokens,
placed after the cache (positions T, T+1, ...), attending to every cached slot and causally to
itself. Memory is bounded by the chunk: one [Hq, P + chunk, N] block of logits per layer at a
time, never [N, N]. The cached states are never modified and nothing is appended to any cache:
the pass runs the model without a cache, through an attention function registered with
transformers under ``ATTN_NAME`` and set on the model only for the pass (restored afterwards),
which prepends the cached keys/values of its layer.

Cheaper variants: ``subsample`` feeds only an evenly spaced share of the chunks (the cost falls
in proportion; slots of skipped chunks are scored by the other chunks' queries only), and
``layers`` scores only some layers, the forward stopping after the deepest one (layers not scored
get ``None``).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Sequence

import torch
from torch import Tensor

from ..strategies.fitted import RECONSTRUCTION_QUERIES
from ..strategies.importance import COPY, RECONSTRUCTION_CHUNK, STAT, SURPRISAL
from ..types import NEG_INF, KVState
from ..validation import check_int, check_range, require

ATTN_NAME = "kvcompress_reconstruct"
# the names the core's strategies read these under (one definition, in the core)
STATS_KEY = STAT  # per-slot statistic [B, H, N]: the reconstruction score
QUERIES_KEY = RECONSTRUCTION_QUERIES  # carried data [B, Hq, R, D]: sampled reconstruction queries
SURPRISAL_KEY = SURPRISAL  # carried data [B, T] float32: each context token's prefill surprisal
COPY_KEY = COPY  # carried data [B, H] float32 per layer: each KV head's copy score in the pass
COPY_REACH = 1  # a reconstruction query "copies" when it attends to its aligned slot or one either side
LOGIT_ROWS = 256  # positions per lm_head call when computing surprisal (memory ~ rows * vocab floats)
REPEAT_INSTRUCTION = "Repeat the previous context exactly."
DEFAULT_CHUNK = RECONSTRUCTION_CHUNK  # the importance guard's band assumes this layout


@dataclass
class Reconstruction:
    """What one reconstruction pass produced.

    scores:   per layer [B, H_kv, N] float32 (None for a layer not scored); padding slots 0
    queries:  per layer [B, Hq, R, D] sampled reconstruction queries (rotated, unscaled) or None
    surprisal: [B, T] float32, -log p(token) of each context token as the pass predicts it from the
              cache and the tokens before it (teacher forced), or None when not asked; padding 0
    copy:     per layer [B, H_kv] float32 (None for a layer not scored): each KV head's copy score,
              the attention mass a reconstruction query of context token t puts on the cached slots
              t - 1, t, t + 1 (the token it is reproducing and its neighbours), averaged over the
              query heads of the group and over the context queries (the repeat prompt's excluded):
              high in the few "retrieval" heads that copy from far context (RazorAttention, DuoAttention)
    seconds:  wall time of the pass; tokens: tokens fed (prompt repeats included); chunks: forwards
    """

    scores: list
    queries: list
    seconds: float
    tokens: int
    chunks: int
    meta: dict = field(default_factory=dict)
    surprisal: Tensor | None = None
    copy: list = field(default_factory=list)


class _StopForward(Exception):
    """Raised by a hook after the deepest scored layer: the rest of the forward is not needed."""


def repeat_prompt_ids(tokenizer, chat: bool | None = None, instruction: str = REPEAT_INSTRUCTION) -> Tensor:
    """[1, P] long: the tokens that ask the model to repeat the context it has just read.

    chat=None uses the tokenizer's chat template when it has one: the user turn that holds the
    context is closed, the instruction is a new user turn, and the assistant's turn begins (the
    context then follows as the assistant's answer). Otherwise plain text: two newlines, the
    instruction, a newline.
    """
    require(isinstance(instruction, str) and instruction.strip() != "", "instruction", instruction,
            "a non-empty instruction")
    use_chat = bool(getattr(tokenizer, "chat_template", None)) if chat is None else bool(chat)
    if use_chat:
        require(bool(getattr(tokenizer, "chat_template", None)), "chat", chat,
                "False for a tokenizer without a chat template")
        marker = "\x00CTX\x00"
        rendered = tokenizer.apply_chat_template(
            [{"role": "user", "content": marker}, {"role": "user", "content": instruction}],
            tokenize=False, add_generation_prompt=True)
        text = rendered[rendered.index(marker) + len(marker):]
    else:
        text = f"\n\n{instruction}\n"
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    require(len(ids) >= 1, "instruction", instruction, "an instruction that renders to at least one token")
    return torch.tensor([ids], dtype=torch.long)


def _as_layers(states_or_kv) -> list[tuple[Tensor, Tensor, Tensor, int]]:
    """(keys, values, bias [B, H, N] float32, tokens seen) per layer."""
    require(isinstance(states_or_kv, (list, tuple)) and len(states_or_kv) > 0, "states_or_kv",
            type(states_or_kv).__name__, "a non-empty list of KVState or (keys, values) pairs, one per layer")
    out = []
    for i, item in enumerate(states_or_kv):
        if isinstance(item, KVState):
            out.append((item.keys, item.values, item.log_sizes, item.num_tokens))
            continue
        require(isinstance(item, (tuple, list)) and len(item) == 2 and all(isinstance(t, Tensor) for t in item),
                f"states_or_kv[{i}]", type(item).__name__, "a KVState or a (keys, values) pair of tensors")
        k, v = item
        require(k.dim() == 4 and tuple(v.shape[:3]) == tuple(k.shape[:3]), f"states_or_kv[{i}]",
                (tuple(k.shape), tuple(v.shape)), "keys and values [B, H, N, D] of one shape")
        bias = torch.zeros(k.shape[:3], dtype=torch.float32, device=k.device)
        out.append((k, v, bias, k.shape[2]))
    B, H, _, D = out[0][0].shape
    for i, (k, _, _, _) in enumerate(out):
        require(k.shape[0] == B and k.shape[1] == H and k.shape[3] == D, f"states_or_kv[{i}]", tuple(k.shape),
                f"[B={B}, H={H}, N, D={D}] like layer 0")
    return out


def _chunk_starts(T: int, chunk: int, subsample: float) -> list[int]:
    """Start of every context chunk fed: all of them, or an evenly spaced share."""
    starts = list(range(0, T, chunk))
    if subsample >= 1.0 or len(starts) <= 1:
        return starts
    n = max(1, int(math.ceil(len(starts) * subsample - 1e-9)))
    picks = torch.linspace(0, len(starts) - 1, n).round().long().unique().tolist()
    return [starts[i] for i in picks]


class _Pass:
    """The attention function of one pass and what it accumulates (one instance per pass)."""

    def __init__(self, layers, scored: set[int], query_samples: int, total_queries: int):
        self.layers = layers
        self.scored = scored
        B, H, N = layers[0][2].shape
        self.scores = {i: torch.zeros(B, H, layers[i][0].shape[2], dtype=torch.float32, device=layers[i][0].device)
                       for i in scored}
        self.samples = query_samples
        self.stride = max(1, total_queries // max(1, query_samples)) if query_samples else 0
        self.queries: dict[int, list] = {i: [] for i in scored}
        self.offset = 0  # index of this chunk's first query among all queries of the pass
        self.query_valid: Tensor | None = None  # [B, q] bool
        self.prompt = 0  # repeat-prompt tokens at the start of the chunk
        self.start = 0  # context index of the chunk's first context token (= its aligned slot)
        self.copy = {i: torch.zeros(B, H, dtype=torch.float32, device=layers[i][0].device) for i in scored}
        self.copy_count = torch.zeros(B, dtype=torch.float32, device=layers[0][0].device)

    def context_valid(self, q: int) -> Tensor:
        """[B, m] float32: which of the chunk's context queries count (not padding)."""
        m = q - self.prompt
        if self.query_valid is None:
            return torch.ones(self.copy_count.shape[0], m, device=self.copy_count.device)
        return self.query_valid[:, self.prompt:].float()

    def _copy_mass(self, p: Tensor) -> Tensor:
        """[B, H]: summed over the chunk's context queries, the attention mass (mean over the G query
        heads of a group) on the aligned slot start + j and its neighbours. p: [B, H, G, q, N]."""
        B, H, G, q, N = p.shape
        m = q - self.prompt
        at = self.start + torch.arange(m, device=p.device)[:, None] + torch.arange(
            -COPY_REACH, COPY_REACH + 1, device=p.device)[None]  # [m, 2R+1]
        inside = ((at >= 0) & (at < N)).float()
        picked = p[:, :, :, self.prompt:].gather(-1, at.clamp(0, N - 1).expand(B, H, G, m, -1))
        mass = (picked * inside).sum(-1).mean(2)  # [B, H, m]
        return (mass * self.context_valid(q)[:, None]).sum(-1)

    def __call__(self, module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
        """query [B, Hq, q, D], key/value [B, H, q, D] (this chunk, rotated): attention over the
        cached slots of the layer followed by the chunk, causal within the chunk."""
        idx = module.layer_idx
        ck, cv, bias, _ = self.layers[idx]
        B, Hq, q, D = query.shape
        H, N = ck.shape[1], ck.shape[2]
        G = Hq // H
        scale = 1.0 / math.sqrt(D) if scaling is None else scaling
        dtype = torch.promote_types(query.dtype, torch.float32)
        # [B, H, G*q, D] @ [B, H, D, N + q]: one batched matmul per layer, GQA without repeating keys
        qf = query.reshape(B, H, G * q, D).to(dtype)
        keys = torch.cat([ck.to(dtype), key.to(dtype)], dim=2)
        logits = torch.matmul(qf, keys.transpose(-1, -2)).mul_(scale)  # [B, H, G*q, N + q]
        causal = torch.ones(q, q, dtype=torch.bool, device=query.device).tril()
        mask = torch.cat([bias[:, :, None, :].expand(B, H, q, N),
                          torch.zeros(q, q, device=query.device).masked_fill(~causal, NEG_INF).expand(B, H, q, q)],
                         dim=-1)  # [B, H, q, N + q]
        logits = logits.view(B, H, G, q, N + q).add_(mask[:, :, None]).view(B, H, G * q, N + q)
        probs = logits.softmax(-1)
        if idx in self.scored:
            p = probs[..., :N].view(B, H, G, q, N)
            if self.query_valid is not None:
                p = p * self.query_valid[:, None, None, :, None]
            self.scores[idx] = torch.maximum(self.scores[idx], p.amax(dim=(2, 3)))
            self.copy[idx] += self._copy_mass(p)
            if self.stride:
                first = (-self.offset) % self.stride  # the first index of this chunk on the stride
                if first < q:
                    self.queries[idx].append(query[:, :, first::self.stride].detach().clone())
        values = torch.cat([cv.to(dtype), value.to(dtype)], dim=2)
        out = torch.matmul(probs, values).view(B, Hq, q, -1)
        out = out.to(query.dtype).transpose(1, 2).contiguous()
        return out, None


def reconstruction_scores(model, states_or_kv, context_ids: Tensor, *, repeat_ids: Tensor,
                          chunk: int = DEFAULT_CHUNK, subsample: float = 1.0,
                          layers: Sequence[int] | None = None, attention_mask: Tensor | None = None,
                          query_samples: int = 0, surprisal: bool = False, lead: int = 0,
                          aligned: bool = False) -> Reconstruction:
    """Reconstruction importance of every cached slot, per layer and KV head.

    model:          a transformers causal LM (Llama-family: ``model.model.layers[i].self_attn``)
    states_or_kv:   per layer a KVState (its log_sizes are the slots' attention bias) or a
                    (keys, values) pair [B, H, N, D] (bias 0); the cache after the prefill
    context_ids:    [B, T] long, the tokens to reconstruct (the cached text, teacher forced)
    repeat_ids:     [1, P] or [B, P] long, the repeat prompt (``repeat_prompt_ids``)
    chunk:          context tokens per forward (memory ~ Hq * (P + chunk) * N floats per layer)
    subsample:      share in (0, 1] of the context chunks fed (evenly spaced)
    layers:         layer indices to score (None = all); the forward stops after the deepest
    attention_mask: [B, T] (1 = token, 0 = left padding) or None: padding tokens' queries count for
                    nothing (their slots should carry bias -inf in the states)
    query_samples:  R > 0 also returns about R reconstruction queries per scored layer, strided
                    evenly over all reconstruction positions
    surprisal:      also return each context token's surprisal under the pass (``token_surprisal``
                    of the last hidden states: the lm_head over the context positions, no extra
                    forward); needs every layer (``layers`` None or holding the last one)
    lead:           L > 0: every chunk but the first is preceded (after the repeat prompt) by the L
                    context tokens before it, teacher forced, so that its first tokens are reproduced
                    mid-stream; without it they come right after the prompt, before the model has found
                    where it copies from, and their sources score low for where they are (a fact at a
                    chunk's start is ranked down: results/issue18-s16dev). The lead-in's queries count
                    in the scores like the prompt's; the copy score and the surprisal read the chunk's
                    own positions. 0: the chunks as KVzip feeds them
    aligned:        every chunk at the positions one full repeat of the context would give it (its token
                    i at start + P + s + i, the repeat prompt and the lead-in just before), so every
                    chunk is copied from the same distance. Without it every chunk sits right after the
                    cache and chunk k is copied from ~T - s: the last from the nearest, where every
                    token's copy attention is high and a fact stands out no more (PG 2k: the last band's
                    median importance 5x the first's; a needle at depth 0.9 ranked 29th-52nd of ~200
                    sentences, aligned 13th-25th; results/issue18-s18). Positions then reach ~2T + P:
                    capped at the model's ``max_position_embeddings`` (the last chunks shift less)
    """
    require(model is not None and hasattr(model, "model") and hasattr(model.model, "layers"), "model",
            type(model).__name__, "a transformers decoder model with .model.layers (model access is required: "
            "the reconstruction scorer runs the model over the context)")
    kv = _as_layers(states_or_kv)
    num_layers = len(model.model.layers)
    require(len(kv) == num_layers, "states_or_kv", f"{len(kv)} layers", f"one entry per decoder layer ({num_layers})")
    require(isinstance(context_ids, Tensor) and context_ids.dim() == 2, "context_ids",
            tuple(getattr(context_ids, "shape", ())), "a [B, T] tensor of token ids")
    B, T = context_ids.shape
    require(T >= 1, "context_ids", tuple(context_ids.shape), "at least one context token (the context is empty)")
    require(B == kv[0][0].shape[0], "context_ids", tuple(context_ids.shape), f"batch {kv[0][0].shape[0]} as the states")
    require(isinstance(repeat_ids, Tensor) and repeat_ids.dim() == 2 and repeat_ids.shape[1] >= 1
            and repeat_ids.shape[0] in (1, B), "repeat_ids", tuple(getattr(repeat_ids, "shape", ())),
            f"a [1, P] or [{B}, P] tensor with P >= 1")
    check_int("chunk", chunk, 1)
    check_range("subsample", subsample, 0.0, 1.0, lo_open=True)
    check_int("query_samples", query_samples, 0)
    check_int("lead", lead, 0)
    require(isinstance(aligned, bool), "aligned", aligned, "True or False")
    scored = set(range(num_layers)) if layers is None else set(int(i) for i in layers)
    require(len(scored) > 0 and all(0 <= i < num_layers for i in scored), "layers", layers,
            f"None or a non-empty list of layer indices in [0, {num_layers})")
    require(isinstance(surprisal, bool), "surprisal", surprisal, "True or False")
    require(not surprisal or max(scored) == num_layers - 1, "layers", layers,
            f"a set holding the last layer ({num_layers - 1}) when surprisal=True (it reads the model's output)")
    if attention_mask is not None:
        require(tuple(attention_mask.shape) == (B, T), "attention_mask", tuple(attention_mask.shape), f"shape {(B, T)}")

    device = kv[0][0].device
    context_ids = context_ids.to(device)
    repeat = repeat_ids.to(device).expand(B, -1)
    P = repeat.shape[1]
    start_pos = max(n for _, _, _, n in kv)  # the pass sits after every token seen
    max_pos = getattr(model.config, "max_position_embeddings", None)
    starts = _chunk_starts(T, chunk, subsample)
    total_q = sum(P + min(lead, s) + min(chunk, T - s) for s in starts)
    run = _Pass(kv, scored, query_samples, total_q)

    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(ATTN_NAME, run)
    AttentionMaskInterface.register(ATTN_NAME, sdpa_mask)
    previous = model.config._attn_implementation
    deepest = max(scored)
    handle = None
    if deepest < num_layers - 1:
        def stop(module, args, output):
            raise _StopForward

        handle = model.model.layers[deepest].register_forward_hook(stop)
    begin = time.perf_counter()
    fed = 0
    sur = torch.zeros(B, T, dtype=torch.float32, device=device) if surprisal else None
    try:
        model.set_attn_implementation(ATTN_NAME)
        with torch.inference_mode():
            for s in starts:
                piece = context_ids[:, s: s + chunk]
                before = context_ids[:, s - min(lead, s): s]  # the lead-in, [B, L'] (none for the first)
                ids = torch.cat([repeat, before, piece], dim=1)  # [B, P + L' + m]
                head = P + before.shape[1]  # queries before the chunk's own
                q = ids.shape[1]
                shift = s - before.shape[1] if aligned else 0  # the chunk's place in one full repeat
                if aligned and max_pos is not None:
                    shift = max(0, min(shift, max_pos - start_pos - q))
                pos = torch.arange(start_pos + shift, start_pos + shift + q, device=device)[None].expand(B, q)
                if attention_mask is not None:
                    real = attention_mask[:, s - before.shape[1]: s + chunk].to(device=device, dtype=torch.bool)
                    run.query_valid = torch.cat([torch.ones(B, P, dtype=torch.bool, device=device), real], 1)
                else:
                    run.query_valid = None
                run.prompt, run.start = head, s
                try:
                    out = model.model(input_ids=ids.clamp(min=0), position_ids=pos, use_cache=False)
                except _StopForward:
                    out = None
                if sur is not None:
                    # position head - 1 + j predicts the chunk's token j (the prompt's or lead-in's last the first)
                    m = piece.shape[1]
                    hidden = out.last_hidden_state[:, head - 1: head - 1 + m]
                    sur[:, s: s + m] = token_surprisal(model.get_output_embeddings(), hidden, piece)
                run.offset += q
                run.copy_count += run.context_valid(q).sum(-1)
                fed += q
    finally:
        if handle is not None:
            handle.remove()
        model.set_attn_implementation(previous)
    seconds = time.perf_counter() - begin
    scores = [run.scores.get(i) for i in range(num_layers)]
    for i, s in enumerate(scores):
        if s is not None:
            scores[i] = s.masked_fill(~(kv[i][2] > NEG_INF), 0.0)
    if sur is not None and attention_mask is not None:
        sur = sur.masked_fill(~attention_mask.to(device=device, dtype=torch.bool), 0.0)
    copy = [run.copy[i] / run.copy_count.clamp(min=1)[:, None] if i in scored else None for i in range(num_layers)]
    queries = [None] * num_layers
    if query_samples:
        for i in scored:
            if run.queries[i]:
                queries[i] = torch.cat(run.queries[i], dim=2)[:, :, :query_samples]
    return Reconstruction(scores=scores, queries=queries, seconds=seconds, tokens=fed, chunks=len(starts),
                          meta={"chunk": chunk, "subsample": subsample, "prompt_tokens": P, "lead": lead,
                                "aligned": aligned,
                                "layers": sorted(scored), "context_tokens": T}, surprisal=sur, copy=copy)


def token_surprisal(head, hidden: Tensor, targets: Tensor, rows: int = LOGIT_ROWS) -> Tensor:
    """[B, m] float32: -log softmax(head(hidden))[target] per position, in float32.

    head: the model's output projection (``get_output_embeddings()``); hidden: [B, m, d] the
    final hidden states (after the model's last norm) of the positions predicting ``targets``
    [B, m] long. The vocabulary logits are built ``rows`` positions at a time, never [m, V] at once.
    """
    B, m = targets.shape
    out = torch.empty(B, m, dtype=torch.float32, device=hidden.device)
    for a in range(0, m, rows):
        logits = head(hidden[:, a: a + rows]).float()  # [B, r, V]
        tgt = targets[:, a: a + rows].clamp(min=0)
        out[:, a: a + rows] = logits.logsumexp(-1) - logits.gather(-1, tgt[..., None])[..., 0]
    return out


def prefill_hook(tokenizer=None, *, chat: bool | None = None, repeat_ids: Tensor | None = None,
                 chunk: int = DEFAULT_CHUNK, subsample: float = 1.0, layers: Sequence[int] | None = None,
                 query_samples: int = 64, lead: int | None = None, aligned: bool | None = None):
    """A ``fn(cache, model)`` for ``CompressedCache.add_prefill_hook``: at the prefill's end, before
    the compression, run the pass over the cache's states and write the scores as the per-slot
    statistic ``"reconstruction"`` (and the sampled queries as ``extras["reconstruction_queries"]``;
    when the cache's pipeline declares ``Needs(surprisal=True)``, each context token's prefill
    surprisal (``prefill_surprisal``) as ``extras["surprisal"]`` [B, T], the same tensor in every layer).

    tokenizer / chat: build the repeat prompt (``repeat_prompt_ids``), unless ``repeat_ids`` is given.
    lead: the chunks' lead-in (``reconstruction_scores``); None: what the cache's pipeline asks for
          (``Needs.pass_lead``).
    aligned: the chunks at their full-repeat positions (``reconstruction_scores``); None: what the cache's
          pipeline asks for (``Needs.pass_aligned``).
    """
    require(repeat_ids is not None or tokenizer is not None, "tokenizer", None,
            "a tokenizer (to build the repeat prompt) or repeat_ids")
    if lead is not None:
        check_int("lead", lead, 0)
    if aligned is not None:
        require(isinstance(aligned, bool), "aligned", aligned, "True, False or None")
    prompt = repeat_ids if repeat_ids is not None else repeat_prompt_ids(tokenizer, chat)

    def hook(cache, model) -> None:
        states = cache.states()
        first = states[0]
        require(first.token_ids is not None, "cache", "no token ids", "a cache that recorded its input ids")
        ids = first.token_ids[:, : first.num_tokens]
        mask = None
        if first.seq_start is not None and bool((first.seq_start > 0).any()):
            mask = (torch.arange(ids.shape[1], device=ids.device)[None] >= first.seq_start[:, None]).long()
        res = reconstruction_scores(model, states, ids, repeat_ids=prompt, chunk=chunk, subsample=subsample,
                                    layers=layers, attention_mask=mask, query_samples=query_samples,
                                    lead=cache.scheduler.needs.pass_lead if lead is None else lead,
                                    aligned=cache.scheduler.needs.pass_aligned if aligned is None else aligned)
        scores = [s if s is not None else torch.zeros_like(st.log_sizes) for s, st in zip(res.scores, states)]
        cache.set_stats(STATS_KEY, scores)
        cache.set_extras(COPY_KEY, [c if c is not None else torch.zeros_like(st.log_sizes[..., 0])
                                    for c, st in zip(res.copy, states)])
        if cache.scheduler.needs.surprisal:
            start = time.perf_counter()
            sur = prefill_surprisal(model, ids, attention_mask=mask)
            cache.set_extras(SURPRISAL_KEY, [sur] * len(states))
            cache.stats["surprisal_s"] = cache.stats.get("surprisal_s", 0.0) + time.perf_counter() - start
        if query_samples:
            cache.set_extras(QUERIES_KEY, res.queries)
        cache.stats["reconstruct_s"] = cache.stats.get("reconstruct_s", 0.0) + res.seconds

    return hook


def prefill_surprisal(model, ids: Tensor, *, attention_mask: Tensor | None = None) -> Tensor:
    """[B, T] float32: each token's surprisal as the model reads the context, -log p(ids[t] | ids[<t])
    (0 for each row's first token, which nothing predicts, and for padding).

    The model's own view of what in the context it could not have guessed: a planted fact or an
    unexpected name scores high, boilerplate low. One forward of the model without any cache
    (its attention implementation set to "sdpa" for the call and restored after: a bound
    CompressedCache is not touched), the lm_head applied ``LOGIT_ROWS`` positions at a time.
    Measured on the dev text (results/issue18-dev3): this is the signal that adds to
    reconstruction importance; the surprisal under the reconstruction pass itself (the
    ``surprisal=True`` of ``reconstruction_scores``, free but a copy is easy everywhere) does not.

    ids: [B, T] long; attention_mask: [B, T] (1 = token, 0 = left padding) or None.
    """
    require(model is not None and hasattr(model, "model"), "model", type(model).__name__,
            "a transformers causal LM (model access is required: surprisal is the model's prediction)")
    require(isinstance(ids, Tensor) and ids.dim() == 2 and not ids.is_floating_point(), "ids",
            f"{tuple(getattr(ids, 'shape', ()))} {getattr(ids, 'dtype', type(ids).__name__)}",
            "a [B, T] integer tensor of token ids")
    require(ids.shape[1] >= 1, "ids", tuple(ids.shape), "at least one context token (the context is empty)")
    B, T = ids.shape
    device = model.get_output_embeddings().weight.device
    ids = ids.to(device)
    kwargs = {}
    if attention_mask is not None:
        require(tuple(attention_mask.shape) == (B, T), "attention_mask", tuple(attention_mask.shape), f"shape {(B, T)}")
        mask = attention_mask.to(device=device, dtype=torch.long)
        kwargs = {"attention_mask": mask, "position_ids": (mask.cumsum(-1) - 1).clamp(min=0)}
    previous = model.config._attn_implementation
    try:
        model.set_attn_implementation("sdpa")
        with torch.inference_mode():
            hidden = model.model(input_ids=ids.clamp(min=0), use_cache=False, **kwargs).last_hidden_state
            out = torch.zeros(B, T, dtype=torch.float32, device=device)
            if T > 1:
                out[:, 1:] = token_surprisal(model.get_output_embeddings(), hidden[:, :-1], ids[:, 1:])
    finally:
        model.set_attn_implementation(previous)
    if attention_mask is not None:  # padding, and each row's first token (predicted from padding)
        real = attention_mask.to(device=device, dtype=torch.bool)
        predicted = real.clone()
        predicted[:, 1:] &= real[:, :-1]
        predicted[:, 0] = False
        out = out.masked_fill(~predicted, 0.0)
    return out
