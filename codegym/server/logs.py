"""Server logs: plain text for people, or one JSON object per line (`--log-format json`) for collectors.

Every record carries the request id of the RPC it belongs to (set by the metrics interceptor for
every call) and, where the call is about a session, its id: a step's log lines can be found by
either in a log store.
"""

from __future__ import annotations

import contextvars
import json
import logging
import time

REQUEST_ID: contextvars.ContextVar[str] = contextvars.ContextVar("request_id", default="")
SESSION_ID: contextvars.ContextVar[str] = contextvars.ContextVar("session_id", default="")
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


class ContextFilter(logging.Filter):
    """Copies the current request and session ids onto every record."""

    def filter(self, record: logging.LogRecord) -> bool:
        record.request_id = REQUEST_ID.get()
        record.session_id = SESSION_ID.get()
        return True


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        for key in ("request_id", "session_id"):
            value = getattr(record, key, "")
            if value:
                entry[key] = value
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry, ensure_ascii=False)


def configure(level: str, fmt: str = "text") -> None:
    """Root logging for a server process: `fmt` is "text" or "json"."""
    handler = logging.StreamHandler()
    handler.addFilter(ContextFilter())
    handler.setFormatter(JsonFormatter() if fmt == "json" else logging.Formatter(TEXT_FORMAT))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
