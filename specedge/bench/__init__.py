"""Benchmarks: `specedge bench` (k sweep over a built-in prompt suite, JSON + PNG, `--tune`).

    from specedge.bench import BenchConfig, run_bench, plot_results
    results = run_bench("bundles/smollm2-135m-instruct", BenchConfig.quick_defaults(threads=2))
    plot_results(results, "bench.png")

`runner` documents the results schema, `stats` the formulas (medians, acceptance pooling,
weight bandwidth). matplotlib (plots) and psutil (machine info) are the `bench` extra.
"""

from .runner import (
    SCHEMA,
    BenchConfig,
    choose_k,
    format_table,
    load_prompts,
    run_bench,
    select_prompts,
    summarize_runs,
    tune_manifest,
    validate_results,
)


def plot_results(results, out, dpi: int = 110):
    """Write the PNG plot of `results` (see `specedge.bench.plot`)."""
    from .plot import plot_results as _plot

    return _plot(results, out, dpi=dpi)


__all__ = [
    "SCHEMA",
    "BenchConfig",
    "choose_k",
    "format_table",
    "load_prompts",
    "plot_results",
    "run_bench",
    "select_prompts",
    "summarize_runs",
    "tune_manifest",
    "validate_results",
]
