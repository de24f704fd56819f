"""The fault campaign: a seeded, concurrent workload against a stack of its own, faults from a
schedule drawn from the same seed, every operation recorded as a history, and checkers of every
promise run over that history (docs/promises.md)."""
