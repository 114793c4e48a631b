"""Prometheus figures of the OpenEnv gateway (served on `--metrics-port`, like the other servers)."""

from __future__ import annotations

from prometheus_client import Counter, Gauge

SOCKETS = Gauge("codegym_openenv_sockets_open", "Open OpenEnv WebSockets")
SESSIONS = Gauge("codegym_openenv_sessions_open", "Runtime sessions held by OpenEnv sockets")
STEPS = Counter(
    "codegym_openenv_steps_total", "Steps through the gateway, by outcome (ok or the error)", ["outcome"]
)
MESSAGES = Counter("codegym_openenv_messages_total", "OpenEnv messages received, by type", ["type"])
ERRORS = Counter("codegym_openenv_errors_total", "OpenEnv error answers, by code", ["code"])
REAPED = Counter("codegym_openenv_reaped_total", "Sockets closed by the idle reaper")
