"""Memory really freed: concurrent 2k-token requests in a fixed KV pool, keep 1.0 / 0.5 / 0.25.

One vLLM engine per keep ratio (each in its own process: one engine at a time, and the CPU flex
kernel must not see two cache sizes in one process), the same workload each time: R requests of
P prompt tokens (distinct windows of the Paul Graham essays) and G greedy new tokens, all
submitted at once to a pool of ``--pool-blocks`` blocks. Reported per keep ratio: the most
requests one engine step ran (concurrency, from the worker's ``kvc_report``), wall time,
throughput (generated tokens/s and prompt+generated tokens/s), blocks freed per request, and the
expected concurrency from the block arithmetic. keep 1.0 runs the plugin with ``full`` (the same
FlexAttention kernel, nothing freed), so the ratios compare like with like.

    KVCOMPRESS_ESSAYS=/work/shared/data/paul_graham_essays nice -n 5 \\
      /work/vllm-venv/bin/python tests_vllm/bench_concurrency.py --out results/vllm-memory/cpu.json

Resumable: keep ratios already in --out are skipped. Needs the vLLM venv (see .ci/vllm).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1", "OMP_NUM_THREADS": "1",
       "VLLM_CPU_OMP_THREADS_BIND": "nobind", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}


def prompts_from_essays(tokenizer, folder: Path, count: int, length: int) -> list[list[int]]:
    """``count`` distinct windows of ``length`` tokens from the essays (one essay after another)."""
    ids: list[int] = []
    for path in sorted(folder.glob("*.txt")):
        if path.name.lower().startswith("license"):
            continue
        ids += tokenizer(path.read_text(errors="replace"), add_special_tokens=False)["input_ids"]
        if len(ids) >= count * length:
            break
    if len(ids) < length:
        raise SystemExit(f"the essays in {folder} hold {len(ids)} tokens, fewer than one prompt of {length}")
    step = max(1, (len(ids) - length) // max(1, count - 1))
    return [ids[i * step % (len(ids) - length + 1):][:length] for i in range(count)]


def run_one(args) -> dict:
    """One engine, one keep ratio (runs in a child process)."""
    from vllm import LLM, SamplingParams, TokensPrompt

    import kvcompress.vllm as kvv

    preset = "full" if args.keep >= 1.0 else args.preset
    budget = None if args.keep >= 1.0 else args.keep
    plugin = kvv.engine_kwargs(preset, budget)
    llm = LLM(args.model, dtype="float32", enforce_eager=True, distributed_executor_backend="uni",
              max_model_len=args.prompt_tokens + args.new_tokens + args.block_size,
              block_size=args.block_size, max_num_seqs=args.max_seqs,
              max_num_batched_tokens=args.prompt_tokens + args.new_tokens + args.block_size,
              num_gpu_blocks_override=args.pool_blocks, seed=0, **plugin)
    prompts = prompts_from_essays(llm.get_tokenizer(), Path(args.essays), args.requests, args.prompt_tokens)
    params = SamplingParams(max_tokens=args.new_tokens, min_tokens=args.new_tokens, temperature=0.0, ignore_eos=True)
    load = os.getloadavg()
    start = time.perf_counter()
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
    wall = time.perf_counter() - start
    report = llm.collective_rpc("kvc_report")[0]
    generated = sum(len(o.outputs[0].token_ids) for o in outs)
    comps = report["compressions"]
    rule = kvv.BlockRule.of(kvv.Settings(preset, budget))
    P, G, bs = args.prompt_tokens, args.new_tokens, args.block_size
    blocks_full = -(-(P + G) // bs)
    blocks_kept = blocks_full - rule.freed(P, bs)
    # the scheduler admits a request when its whole prompt fits (vLLM's scheduler_reserve_full_isl),
    # so one prompt's blocks stay in reserve for the next admission
    expected = blocks_full and (args.pool_blocks // blocks_full if blocks_kept == blocks_full
                                else 1 + (args.pool_blocks - -(-P // bs)) // blocks_kept)
    return {
        "keep": args.keep, "preset": preset, "budget": budget,
        "max_concurrent_requests": report["max_batch"], "expected_concurrency": expected,
        "reused_freed_blocks": report["reused_freed_blocks"],
        "wall_s": wall, "generated_tokens": generated, "generated_tokens_per_s": generated / wall,
        "total_tokens_per_s": (generated + P * len(prompts)) / wall,
        "blocks_per_request_full": blocks_full, "blocks_per_request_kept": blocks_kept,
        "compressions": len(comps), "distinct_requests_compressed": len({c["request_id"] for c in comps}),
        "preemption_recompressions": len(comps) - len({c["request_id"] for c in comps}),
        "trimmed_layers": sum(c["trimmed_layers"] for c in comps),
        "mean_compress_s": sum(c["seconds"] for c in comps) / max(1, len(comps)),
        "mean_slots_per_layer": (sum(sum(c["slots_per_layer"]) / len(c["slots_per_layer"]) for c in comps)
                                 / max(1, len(comps))),
        "loadavg_before": load, "loadavg_after": os.getloadavg(),
    }


def machine() -> dict:
    import torch
    import vllm

    cpu = "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {"cpu": cpu, "cores": os.cpu_count(), "threads": 1, "python": platform.python_version(),
            "torch": torch.__version__, "vllm": vllm.__version__, "dtype": "float32",
            "note": "2-core machine shared with other sessions; see loadavg per run"}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="results/vllm-memory/cpu.json")
    ap.add_argument("--keeps", type=float, nargs="+", default=[1.0, 0.5, 0.25])
    ap.add_argument("--preset", default="semanticache")
    ap.add_argument("--prompt-tokens", type=int, default=2048)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--requests", type=int, default=20)
    ap.add_argument("--pool-blocks", type=int, default=325, help="fixed KV pool (5 uncompressed requests)")
    ap.add_argument("--block-size", type=int, default=32)
    ap.add_argument("--max-seqs", type=int, default=32)
    ap.add_argument("--model", default=None, help="converted model folder (default: kvcompress.vllm.convert)")
    ap.add_argument("--essays", default=os.environ.get("KVCOMPRESS_ESSAYS", "/work/shared/data/paul_graham_essays"))
    ap.add_argument("--keep", type=float, default=None, help=argparse.SUPPRESS)  # child mode
    ap.add_argument("--result-file", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    for k, v in ENV.items():
        os.environ.setdefault(k, v)
    if args.model is None:
        from kvcompress.vllm.convert import smollm2_folder

        args.model = str(smollm2_folder())
    if args.keep is not None:
        Path(args.result_file).write_text(json.dumps(run_one(args)))
        return
    out = Path(args.out)
    data = json.loads(out.read_text()) if out.exists() else {}
    data.update({"machine": machine(), "command": " ".join([Path(sys.executable).name, *sys.argv]),
                 "workload": {k: getattr(args, k) for k in ("preset", "prompt_tokens", "new_tokens", "requests",
                                                            "pool_blocks", "block_size", "max_seqs")}})
    runs = {float(r["keep"]): r for r in data.get("runs", [])}
    for keep in args.keeps:
        if keep in runs:
            print(f"keep {keep}: done already", flush=True)
            continue
        result = out.with_name(f".{out.name}.keep{keep}.tmp")
        result.parent.mkdir(parents=True, exist_ok=True)
        result.unlink(missing_ok=True)
        child = [sys.executable, __file__, *(argv if argv is not None else sys.argv[1:]), "--keep", str(keep),
                 "--model", args.model, "--result-file", str(result)]
        proc = subprocess.run(child)  # its log goes where ours goes
        if proc.returncode != 0 or not result.exists():
            raise SystemExit(f"keep {keep}: the engine failed (exit {proc.returncode})")
        runs[keep] = json.loads(result.read_text())
        result.unlink()
        print(json.dumps(runs[keep]), flush=True)
        data["runs"] = [runs[k] for k in sorted(runs, reverse=True)]
        base = runs.get(1.0)
        if base:
            for r in data["runs"]:
                r["concurrency_vs_keep1"] = r["max_concurrent_requests"] / base["max_concurrent_requests"]
                r["throughput_vs_keep1"] = r["generated_tokens_per_s"] / base["generated_tokens_per_s"]
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(data, indent=2) + "\n")


if __name__ == "__main__":
    main()
