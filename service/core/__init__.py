"""The types every layer shares: the jobs that cross from the HTTP side to the engine (jobs.py), the
prefixes a micro-batch's sequences share (prefixes.py), the error taxonomy with its one status table
(errors.py), and the objects a server holds for its lifetime (heap.py). numpy only; no torch."""
