"""Benchmarks of the admission path against the obvious alternative (`budgetgate bench …`).

Benchmarks run outside the test suite: they start their own services and databases and measure
wall-clock figures, which no test should assert on.
"""
