import os, sys, time
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

if __name__ == "__main__":
    from vllm import LLM, SamplingParams
    import kvcompress.vllm as kvv
    from kvcompress.vllm.convert import smollm2_folder
    folder = str(smollm2_folder())
    mode = sys.argv[1]
    kw = dict(dtype="float32", enforce_eager=True, distributed_executor_backend="uni", max_model_len=2048,
              num_gpu_blocks_override=96, block_size=32, max_num_seqs=4, max_num_batched_tokens=2048)
    if mode != "stock":
        kw.update(kvv.engine_kwargs(mode if mode != "none" else None, float(sys.argv[2]) if len(sys.argv) > 2 else None))
    t = time.time()
    llm = LLM(folder, **kw)
    print("load", time.time() - t, flush=True)
    text = open("/work/shared/data/paul_graham_essays/" + sorted(os.listdir("/work/shared/data/paul_graham_essays"))[0]).read()[:2500]
    prompt = text + "\n\nSummarize the text above in one sentence:"
    t = time.time()
    out = llm.generate([prompt], SamplingParams(max_tokens=16, temperature=0))
    print("gen", time.time() - t, out[0].outputs[0].token_ids, repr(out[0].outputs[0].text), len(out[0].prompt_token_ids))
    if mode != "stock":
        print(llm.collective_rpc("kvc_report"))
