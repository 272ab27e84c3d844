"""Benchmarks (``python -m bench`` runs them all short and checks every goal; see goals.py)."""
