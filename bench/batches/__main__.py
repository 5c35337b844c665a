"""`python -m bench.batches`: see run.py."""

from bench.batches.run import main

raise SystemExit(main())
