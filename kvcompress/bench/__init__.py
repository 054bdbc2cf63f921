"""Efficiency benchmark: decode speed, memory and compression cost, full vs compressed caches.

    from kvcompress.bench import BenchSettings, run_bench
    results = run_bench(BenchSettings(models=("smollm2",), lengths=(2048,)), out="efficiency.json")

or ``kvcompress bench`` (see ``kvcompress/cli_bench.py``). Modules: ``sources`` (models and
contexts), ``caches`` (the caches built from one prefill), ``timing``, ``memory`` (peak RSS),
``profiling``, ``floors`` (issue 7's pass / fail checks), ``plots``, ``machine``, ``runner``.
"""

from .floors import evaluate as evaluate_floors
from .runner import BenchSettings, Benchmark, run_bench

__all__ = ["BenchSettings", "Benchmark", "run_bench", "evaluate_floors"]
