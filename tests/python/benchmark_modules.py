"""The benchmark scripts, loaded as modules by the tests and by the scenarios their ranks run."""

import importlib.util
import sys
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def load_benchmark(script):
    """A benchmark script as a module, its main() not run."""
    spec = importlib.util.spec_from_file_location(script.removesuffix(".py") + "_benchmark", BENCHMARKS / script)
    benchmark = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = benchmark  # where a dataclass looks its module up while the module runs
    spec.loader.exec_module(benchmark)
    return benchmark
