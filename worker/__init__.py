"""redbatch worker: Redis Streams in, length-bucketed dynamic batches, one reply per request out."""
