from bench.throughput.cli import main

raise SystemExit(main())
