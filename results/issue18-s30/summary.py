"""Tables of session 30's held-out runs (seeds 31 at 4k, 32 at 2k), per method, with session 28's table code.

    python results/issue18-s30/summary.py
"""

import importlib.util
from pathlib import Path

HERE = Path(__file__).resolve().parent
ORDER = ["full", "kvzip-copy-heads-layers-sentences", "kvzip-copy-heads-layers", "kvzip-copy-heads-noquery",
         "snapkv", "kvzip", "streamingllm"]

_spec = importlib.util.spec_from_file_location("s28_summary", HERE.parent / "issue18-s28" / "summary.py")
s28 = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(s28)

if __name__ == "__main__":
    s28.main(HERE, ORDER)
