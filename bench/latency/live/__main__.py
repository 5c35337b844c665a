"""`python -m bench.latency.live`: the latency target on real processes."""

from bench.latency.live.run import main

raise SystemExit(main())
