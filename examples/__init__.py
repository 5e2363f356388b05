"""Runnable examples of using logprobd from a trainer (`python -m examples.<name>`)."""
