"""The test suite: see docs/architecture.md, "Tests", for which folder to run."""
