"""Efficiency benchmark (issue 7): a thin wrapper around ``kvcompress bench``.

    python benchmarks/bench_efficiency.py [kvcompress bench options]   # e.g. --quick, --threads 1

See kvcompress/cli_bench.py and docs/performance.md.
"""

import sys

from kvcompress.cli_bench import main

if __name__ == "__main__":
    sys.exit(main())
