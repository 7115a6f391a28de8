"""What runs processes: the CLI, `specrl up`, the RL supervisor, eval-policy, launch, traffic and
the benchmarks. The only part of `specrl/` that imports `specrl.serving` or `specrl.trainer`."""
