"""One module per `python -m worker` command: run, demo, stats, dead-letters, calibrate."""
