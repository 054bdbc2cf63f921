"""Offline analysis of the probe's per-sample dumps (probe.py --dump DIR): where the reconstruction
importance lies along the context, and the fact sentence's rank and selection with and without the
guard's ``band`` (each token's importance relative to the median of its 512-token reconstruction chunk).

    python results/issue18-dev7/analyze.py /tmp/h18-dev7/word-4k [/tmp/h18-dev7/word-2k ...]
"""
import glob
import os
import sys

import torch

from kvcompress.strategies.importance import RECONSTRUCTION_CHUNK, band_relative, ranks01, sentence_median
from kvcompress.strategies.sentences import select_sentences, sentence_sum

QUERY_SHARE = 0.2  # kvzip-copy-heads-fitted


def chosen(imp, x, sid, num, elig, vs):
    """The guard's choice (query part by the window signal, the rest by median importance +
    surprisal ranks) from ``imp`` [T]: (fact rank under the score, fact chosen)."""
    lengths, allowance, signal = x["lengths"], x["allowance"], x["signal"]
    T = imp.shape[0]
    med = sentence_median(imp[None], sid[None], num)[0]
    sur = sentence_sum(x["surprisal"][None].float(), sid[None], num)[0] / sentence_sum(
        torch.ones(1, T), sid[None], num)[0].clamp(min=1)
    score = ranks01(med[None], elig[None])[0] + ranks01(sur[None], elig[None])[0] + 1e-6 * elig
    part = int(allowance * QUERY_SHARE)
    c = select_sentences(signal[None], lengths[None], torch.tensor([part]), (elig & (signal > 0))[None])[0]
    left = allowance - int((lengths * c).sum())
    c = c | select_sentences(score[None], lengths[None], torch.tensor([left]), (elig & ~c)[None])[0]
    return int(((score > score[vs]) & elig).sum()), bool(c[vs]), int(((med > med[vs]) & elig).sum())


for d in sys.argv[1:]:
    print(f"\n## {d}\n")
    print("| sample | median importance per 512-token chunk, / the largest | fact chunk | median rank | "
          "score rank | chosen | banded: median rank | score rank | chosen |")
    print("|---|---|---|---|---|---|---|---|---|")
    for f in sorted(glob.glob(os.path.join(d, "*.pt"))):
        x = torch.load(f)
        imp, sid, T = x["imp"].float(), x["sid"], x["imp"].shape[0]
        free = ~x["already"]
        band = torch.arange(T) // RECONSTRUCTION_CHUNK
        nb = int(band.max()) + 1
        med = torch.tensor([float(imp[(band == b) & free].median()) if bool(((band == b) & free).any())
                            else float("nan") for b in range(nb)])
        top = float(med.nan_to_num(0).max())
        prof = " ".join(f"{float(m / top):.2f}" for m in med if not torch.isnan(m))
        v0, v1 = x["spans"]["value"]
        vs = int(sid[(v0 + v1 - 1) // 2])
        num = int(sid.max()) + 1
        elig = x["lengths"] > 0
        r0, c0, m0 = chosen(imp, x, sid, num, elig, vs)
        rel = band_relative(imp[None], free[None], RECONSTRUCTION_CHUNK)[0]
        r1, c1, m1 = chosen(rel, x, sid, num, elig, vs)
        assert c0 == bool(x["keep"][v0:v1].all()), "the simulation differs from the guard"
        name = os.path.basename(f)[:-3].split("-L")[1]
        print(f"| {name} | {prof} | {v0 // RECONSTRUCTION_CHUNK} | {m0} | {r0} | {c0} | {m1} | {r1} | {c1} |")
