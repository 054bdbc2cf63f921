"""Tables and summary.json of the issue-18 target grid, session 9 (results/issue18-grid4/*/cells.jsonl):
the same tables as results/issue18-grid/summary.py, whose code this reuses. Every method ran in the
same process per task (no seeded cells).

    python results/issue18-grid4/summary.py           # markdown to stdout, summary.json beside this file
"""

import importlib.util
from pathlib import Path

HERE = Path(__file__).parent
spec = importlib.util.spec_from_file_location("grid_summary", HERE.parent / "issue18-grid" / "summary.py")
grid = importlib.util.module_from_spec(spec)
spec.loader.exec_module(grid)

if __name__ == "__main__":
    grid.main(HERE, "results/issue18-grid4/run.sh (every method in one run per task, nothing seeded)")
