"""`python -m bench.redis_cluster`: Redis Cluster against one Redis."""

from bench.redis_cluster.compare import main

main()
