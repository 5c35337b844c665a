"""`python -m bench.dashboard`: the Grafana dashboard drawn from a real run."""

from bench.dashboard.snapshot import main

raise SystemExit(main())
