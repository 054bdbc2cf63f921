"""Tables and summary.json of the issue-18 target grid, session 7 (results/issue18-grid3/*/cells.jsonl):
the same tables as results/issue18-grid/summary.py, whose code this reuses.

    python results/issue18-grid3/summary.py           # markdown to stdout, summary.json beside this file
"""

import importlib.util
from pathlib import Path

HERE = Path(__file__).parent
spec = importlib.util.spec_from_file_location("grid_summary", HERE.parent / "issue18-grid" / "summary.py")
grid = importlib.util.module_from_spec(spec)
spec.loader.exec_module(grid)

if __name__ == "__main__":
    grid.main(HERE, "python results/issue18-grid3/seed.py; results/issue18-grid3/run.sh (cells of "
                    "results/issue18-grid2 seeded; only the new preset runs)")
