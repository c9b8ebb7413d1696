"""Benchmarks: programs that print a table and write their numbers under bench/results/."""
