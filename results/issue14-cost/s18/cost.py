"""Session 18's cost run: results/issue14-cost/s16/cost.py (the "old" variant, --old DIR = main dce3317's fitted.py /
fitting.py pair, called with ``owned`` as the pipeline calls it), the same arguments. The evaluations of the session
were paused (SIGSTOP) during the run recorded in cost-s18-split.json (its "note" field says so)."""
import runpy
import sys
from pathlib import Path

sys.argv[0] = str(Path(__file__).parent.parent / "s16" / "cost.py")
runpy.run_path(sys.argv[0], run_name="__main__")
