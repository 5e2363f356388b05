"""The answer of a /logprobs request: per-sequence scores laid back out in the request's layout
(layout.py), with the KL estimators and rollout-mismatch statistics over its action tokens
(diagnostics.py). numpy, float64 where it sums."""
