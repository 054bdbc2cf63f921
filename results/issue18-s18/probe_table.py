"""The needle's sentences in the importance guard's ranking, from probe09.sh's files (issue 18, session 18).
    python results/issue18-s18/probe_table.py        # markdown to stdout"""
import json
import re
from pathlib import Path

HERE = Path(__file__).parent
print("| sample | depth | needle band | kept | needle score | place / eligible | chosen by rank | lowest chosen | "
      "window picks in its band | importance / surprisal rank |")
print("|---|---|---|---|---|---|---|---|---|---|")
for f in sorted(HERE.glob("probe0*.json"), key=lambda f: (re.sub(r"probe\d\d-", "", f.stem), f.stem)):
    text = f.read_text()
    if "{" not in text:
        continue
    d = json.loads(text[text.index("{"):])
    dd, name = re.match(r"probe(\d\d)-(.*)", f.stem).groups()
    depth = f"{dd[0]}.{dd[1]}"
    for n in d["needle_sentences"]:
        band = next(b for b in d["bands"] if b["band"] == n["band"])
        print(f"| {name} | {depth} | {n['band']} | {d['kept_share_of_needle_tokens']:.2f} | {n['score']} | "
              f"{n['place']} / {n['of']} | {d['chosen_by_rank']} | {d['lowest_chosen_score']} | {band['chosen_by_window']} | "
              f"{n['importance_rank01']} / {n['surprisal_rank01']} |")
