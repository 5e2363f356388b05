"""One ScoringEngine over several ranks of one host: rank 0 serves and every call reaches the followers
in order (ranks.py); what can run, each rank's device, the process group and its scorer (replica.py).
Each rank runs a scorer/ PackedScorer over its shards, split as parallel/ plans."""
