"""Benchmarks behind `specrl bench ...`: side-by-side runs, a table, JSON and a PNG."""
