"""Everything that sends a Redis command, each module with its own Lua: reading, replying,
reclaiming, dead letters, maintenance, queue inspection, and the embedded redis-server."""
