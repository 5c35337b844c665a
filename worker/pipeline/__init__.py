"""The data path inside a worker process: the Worker wires one thread per loop (intake,
compute per model instance, reply) around the batcher and the answer queue."""
