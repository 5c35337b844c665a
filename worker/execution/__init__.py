"""Running batches on a device with torch, and no Redis: the executor's three steps, CUDA
streams, memory readings, the governed runner with out-of-memory splits, calibration."""
