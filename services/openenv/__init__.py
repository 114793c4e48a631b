"""OpenEnv gateway: OpenEnv's WebSocket protocol in front of the runtime (`codegym serve openenv`).

Stateless: every session lives in the runtime; the gateway only translates messages, one runtime
session per socket at a time. See `services/openenv/gateway.py`.
"""
