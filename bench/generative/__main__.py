"""`python -m bench.generative`: the generative benchmark."""

from bench.generative.run import main

raise SystemExit(main())
