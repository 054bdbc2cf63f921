"""Session 26's cost run: results/issue14-cost/s16/cost.py with the question-free presets added to its pairs
(kvzip-copy-heads-noquery / -aligned, twin = the same config with the mean merger), the same arguments.

    nice -n 5 python results/issue14-s26/cost.py --states results/tmp/s26/states-8k.pt \
        --presets kvzip-copy-heads-noquery --variants "preset;query_stride=2" --repeats 3 --out results/issue14-s26/cost.json
(states: results/issue14-cost/profile-s9/capture.py run with pipeline="kvzip-copy-heads-noquery")."""
import runpy
import sys
from pathlib import Path

src = Path(__file__).parent.parent / "issue14-cost" / "s16" / "cost.py"
code = src.read_text().replace('"kvzip-copy-heads-banded": (None, {})}',
                               '"kvzip-copy-heads-banded": (None, {}), "kvzip-copy-heads-noquery": (None, {}), '
                               '"kvzip-copy-heads-aligned": (None, {})}')
assert "kvzip-copy-heads-noquery" in code
sys.argv[0] = str(src)
exec(compile(code, str(src), "exec"), {"__name__": "__main__", "__file__": str(src)})
