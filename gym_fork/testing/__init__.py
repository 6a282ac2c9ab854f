"""Test rigs shipped for the demo, the tests and the benchmarks (local multi-node set-ups)."""
