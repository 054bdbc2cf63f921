"""Needle start token and its offset in its 512-token reconstruction chunk, for every fact sample of the seeds given
(default 0-2; the eval's own fact_samples / niah_samples / build_prompt / token_span; tokenizer only).
    python results/issue18-s16dev/positions.py > results/issue18-s16dev/positions.txt
    python results/issue18-s16dev/positions.py 3 > results/issue18-s17dev/positions-s3.txt"""
import sys

from kvcompress.hf.loading import load_tokenizer
from kvcompress.eval.data import Haystack, load_haystack_text, token_span
from kvcompress.eval.facts import fact_samples
from kvcompress.eval.niah import niah_samples
from kvcompress.eval.greedy import build_prompt
tok = load_tokenizer()
hay = Haystack(*load_haystack_text("/work/shared/data/paul_graham_essays"))
for seed in [int(a) for a in sys.argv[1:]] or (0, 1, 2):
    for kind, L_, dis in (("number-niah", 2048, False), ("number", 2048, True), ("code-word", 2048, False), ("number", 4096, True), ("number-niah", 4096, False), ("code-word", 4096, False)):
        depths = [0.1, 0.3, 0.5, 0.7, 0.9]
        ss = niah_samples(tok, hay, [L_], depths, 2, kind="number", seed=seed) if kind == "number-niah" else fact_samples(tok, hay, [L_], depths, 2, kind=kind, distractors=dis, seed=seed)
        row = []
        for s in ss:
            p = build_prompt(tok, s.context, s.question, None)
            a, b = token_span(p.offsets, s.spans["needle"], shift=p.context_offset)
            row.append(f"{s.sample_id.split('-L')[1]}:{a}({a % 512})")
        print(seed, kind, L_, dis, " ".join(row))
