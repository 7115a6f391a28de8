"""Benchmarks behind `specrl bench ...`: side-by-side runs, a table, JSON and a PNG."""


def register(sub) -> None:
    from specrl.apps.bench import adapt, engine, fleet, index, kernels, learn, linears, quality, serve

    bench = sub.add_parser("bench", help="benchmarks (print a table, write JSON and PNG)")
    benches = bench.add_subparsers(title="benchmarks")
    for module in (engine, quality, linears, serve, adapt, learn, kernels, index, fleet):
        module.register(benches)
