"""Synthetic tasks with verifiable answers (the embedded models are trained on them)."""
