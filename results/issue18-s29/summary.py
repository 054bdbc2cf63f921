"""Tables of the held-out runs of sessions 29 (seeds 28-30), 30 (seeds 31-32) and 31 (seeds 33-35), per method, with session 28's table code.

    python results/issue18-s29/summary.py                       # session 29's folder
    python results/issue18-s29/summary.py results/issue18-s30   # session 30's
"""

import importlib.util
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ORDER = ["full", "kvzip-copy-heads-upper", "kvzip-copy-heads-layers-sentences", "kvzip-copy-heads-layers", "kvzip-copy-heads-noquery",
         "snapkv", "kvzip", "streamingllm"]

_spec = importlib.util.spec_from_file_location("s28_summary", HERE.parent / "issue18-s28" / "summary.py")
s28 = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(s28)

if __name__ == "__main__":
    s28.main(Path(sys.argv[1]).resolve() if len(sys.argv) > 1 else HERE, ORDER)
