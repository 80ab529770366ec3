"""Evaluation data and tasks built from real, offline texts."""
