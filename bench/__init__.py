"""redbatch benchmarks: `python -m bench` measures the worker against the offline limit,
FIFO batching and Redis itself, and writes a JSON + Markdown report under bench/results/."""
