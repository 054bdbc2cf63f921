"""Shared helpers for the tests: tiny random states, slow reference loops, hypothesis settings.

Test modules import the helpers directly (``from conftest import make_state``); pytest puts this
directory on sys.path (rootdir-relative "prepend" import mode, tests/ has no __init__.py).
"""

from __future__ import annotations

import math

import torch
from hypothesis import HealthCheck, settings

from kvcompress.types import KVState

# Every core property test runs at most ~50 examples so the suite stays fast on 2 CPU cores.
CORE_SETTINGS = settings(
    max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)

# BPE-like decoded token texts: fused delimiters must count as delimiters.
BPE_VOCAB = (
    "hello", " world", ".\n", " ,", "\n\n", "ing", " the", "?", " cat", "!", "\t", " sat", "s", " on",
    " mat", ".", " dog", " a", "),", " big",
)
DELIMITER_TEXTS = {".\n", " ,", "\n\n", "?", "!", "\t", ".", "),"}


def random_keys(gen: torch.Generator, B: int, H: int, N: int, D: int, prototypes: int = 3) -> torch.Tensor:
    """[B, H, N, D] keys drawn around a few prototypes, so cosines spread over [-1, 1] and
    thresholds actually separate merges from non-merges."""
    protos = torch.randn(B, H, prototypes, D, generator=gen)
    pick = torch.randint(0, prototypes, (B, H, N), generator=gen)
    base = protos.gather(2, pick[..., None].expand(B, H, N, D))
    return base + 0.6 * torch.randn(B, H, N, D, generator=gen)


def make_state(
    seed: int, B: int = 2, H: int = 2, N: int = 24, D: int = 8, *, vocab=BPE_VOCAB, pad=None,
    protected=None, with_membership: bool = True, prototypes: int = 3,
) -> KVState:
    """An uncompressed random state with token ids over ``vocab``.

    pad: optional list of left-padding lengths per row.
    with_membership: stats["member"] [B, H, N, T] one-hot of each slot's tokens; the mergers sum
    stats over members, so after any number of merges it says which tokens each slot holds.
    """
    gen = torch.Generator().manual_seed(seed)
    keys = random_keys(gen, B, H, N, D, prototypes)
    values = torch.randn(B, H, N, D, generator=gen)
    token_ids = torch.randint(0, len(vocab), (B, N), generator=gen)
    mask = None
    if pad is not None:
        mask = torch.ones(B, N, dtype=torch.long)
        for b, p in enumerate(pad):
            mask[b, :p] = 0
    state = KVState.from_raw(keys, values, token_ids=token_ids, attention_mask=mask, protected=protected,
                             vocab=vocab)
    if with_membership:
        member = torch.eye(N).expand(B, H, N, N).clone()
        if mask is not None:
            member = member * mask[:, None, :, None].float()
        state = state.replace(stats={"member": member})
    return state


def clone_state(state: KVState) -> dict:
    """Deep copies of every tensor of a state, to check later that nothing wrote into it."""
    out = {}
    for name in ("keys", "values", "log_sizes", "positions", "token_ids", "protected", "seq_start"):
        t = getattr(state, name)
        out[name] = None if t is None else t.clone()
    return out


def assert_state_unchanged(state: KVState, snapshot: dict) -> None:
    for name, before in snapshot.items():
        after = getattr(state, name)
        if before is None:
            assert after is None, name
        else:
            assert after.dtype == before.dtype and after.shape == before.shape, f"{name} was replaced"
            # bit patterns, so NaN payloads count as unchanged
            same = torch.equal(after.contiguous().view(torch.uint8), before.contiguous().view(torch.uint8))
            assert same, f"{name} was modified"


def reference_gsc(keys: torch.Tensor, chunk_ids: torch.Tensor, valid: torch.Tensor, tau: float) -> torch.Tensor:
    """The obviously-correct slow GSC: parent [B, H, N] long (-1 for invalid slots).

    For each (b, h) and each chunk: walk the chunk's slots in slot order; the first unassigned
    slot becomes a seed and absorbs every later unassigned slot of the chunk whose cosine with the
    SEED's key is > tau. Cosines in float64.
    """
    B, H, N, _ = keys.shape
    parent = torch.full((B, H, N), -1, dtype=torch.long)
    for b in range(B):
        for h in range(H):
            cos = _cosines(keys[b, h])
            for n in range(N):
                if valid[b, h, n]:
                    parent[b, h, n] = n
            chunks = sorted({int(c) for c in chunk_ids[b, h].tolist() if c >= 0})
            for c in chunks:
                members = [n for n in range(N) if int(chunk_ids[b, h, n]) == c]
                assigned = set()
                for i, s in enumerate(members):
                    if s in assigned:
                        continue
                    for t in members[i + 1:]:
                        if t not in assigned and cos[s][t] > tau:
                            assigned.add(t)
                            parent[b, h, t] = s
    return parent


def _cosines(k: torch.Tensor) -> list[list[float]]:
    """All pairwise cosines of [N, D] keys in float64 as nested lists (0 for a zero key)."""
    k = k.double()
    norms = k.norm(dim=-1)
    unit = k / torch.where(norms > 0, norms, 1.0)[:, None]
    return (unit @ unit.T).tolist()


def min_gap_to_tau(keys: torch.Tensor, chunk_ids: torch.Tensor, tau: float) -> float:
    """Smallest |cos - tau| over same-chunk pairs (float64): a test skips near-ties, where float32
    rounding may legitimately decide either way."""
    kn = torch.nn.functional.normalize(keys.double(), dim=-1)
    sims = kn @ kn.transpose(-1, -2)  # [B, H, N, N]
    same = (chunk_ids[..., :, None] == chunk_ids[..., None, :]) & (chunk_ids[..., :, None] >= 0)
    if not bool(same.any()):
        return math.inf
    return float((sims - tau).abs()[same].min())


def members_of(state: KVState) -> torch.Tensor:
    """[B, H, N, T] float: how many times each token is inside each slot (needs stats['member'])."""
    return state.stats["member"]


def token_chunk_ids(token_ids: torch.Tensor, start: torch.Tensor, delimiters=DELIMITER_TEXTS, vocab=BPE_VOCAB):
    """[B, T] long: for each token, the number of delimiter tokens at or before it (a token's
    delimiter-chunk), and [B, T] bool: whether it is a delimiter. Left padding is ignored."""
    B, T = token_ids.shape
    is_delim = torch.zeros(B, T, dtype=torch.bool)
    for b in range(B):
        for t in range(int(start[b]), T):
            is_delim[b, t] = vocab[int(token_ids[b, t])] in delimiters
    return is_delim.long().cumsum(1), is_delim
