"""Experiment drivers: benchmarks, paper-table reproduction, ablations (run from the repo root).

  python -m experiments.benchmark ...      step costs, c, verify cost, tokens/s
  python -m experiments.reproduce --table 2
  python -m experiments.ablate ...         gamma and c sweeps against Theorem 3.8
  python -m experiments.batch_scaling ...  speedup against batch size
  python -m experiments.results_readme     README 'Results' section from the outputs
"""
