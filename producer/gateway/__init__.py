"""An OpenAI-compatible HTTP gateway in front of redbatch workers (`python -m producer serve`).

Stateless: every gateway process talks to Redis through `producer.AsyncClient`, so any number
of them can share one Redis. See docs/gateway.md.
"""
