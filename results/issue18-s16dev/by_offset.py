"""Hits of the full cache and of kvzip-copy-heads-banded by where the needle sits (chunk start, depth 0.9, other),
from the cells of grid6 (seed 0), issue18-heldout (seed 1), issue18-seed2 (seed 2) and positions.txt.
    python results/issue18-s16dev/by_offset.py   (from the repository root)"""
import json,re,subprocess
pos={}
for line in open("results/issue18-s16dev/positions.txt"):
    p=line.split()
    seed,kind,L,dis=p[0],p[1],p[2],p[3]
    for item in p[4:]:
        sid,rest=item.split(":"); a,off=re.match(r"(\d+)\((\d+)\)",rest).groups()
        pos[(seed,kind,L,dis,sid)]=(int(a),int(off))
roots={"0":"results/issue18-grid6","1":"results/issue18-heldout","2":"results/issue18-seed2"}
tasks={"distractors":("number","True"),"number":("number-niah","False"),"word":("code-word","False")}
for L in ("2048","4096"):
  for t,(kind,dis) in tasks.items():
    agg={}
    for seed,root in roots.items():
        f=f"{root}/{t}-{int(L)//1024}k/cells.jsonl"
        try: rows=[json.loads(l) for l in open(f)]
        except FileNotFoundError: continue
        full={r["sample_id"]:r["hit"] for r in rows if r["method"]=="full"}
        for r in rows:
            if r["method"]!="kvzip-copy-heads-banded": continue
            sid=r["sample_id"].split("-L")[1]
            a,off=pos[(seed,kind,L,dis,sid)]
            cat="chunk start (offset<32 or >=500)" if off<32 or off>=500 else ("d0.9" if r["depth"]==0.9 else "d0.1-0.7 other")
            c=agg.setdefault(cat,[0,0,0]); c[0]+=1; c[1]+=bool(full[r["sample_id"]]); c[2]+=bool(r["hit"])
    print(L,t,{k:f"n={v[0]} full {v[1]} preset {v[2]}" for k,v in agg.items()})
