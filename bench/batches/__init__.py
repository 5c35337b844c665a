"""Batch jobs: the Batch API against python -m producer (run.py)."""
