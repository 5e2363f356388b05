"""One-off probes: each answers one question about where time goes (a kernel's passes, the host's
share of a round, a garbage collection, an A/B of two trees), run by hand when that question comes
up. Their figures are not BENCHMARKS.md's; what they found is in docs/benchmark-history.md."""
