"""`python -m bench.gateway`: the gateway against the direct protocol."""

from bench.gateway.compare import main

raise SystemExit(main())
