"""Pure decisions: batching, the memory governor, flow (in-flight, flush, claim or read),
backoff. Nothing here does I/O, keeps time or starts a thread; times and counts are passed
in, and every rule is unit-tested directly (tests/unit/test_architecture.py holds the import
rule)."""
