from bench.peers.cli import main

raise SystemExit(main())
