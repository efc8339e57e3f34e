"""Credentials in worker URLs never leave the router: not in an answer, a metric or a log.

A worker may be registered as ``http://user:password@host:port`` (a worker behind
an authenticating proxy). The router needs the credentials to reach it, and
nothing else does: every text a client, a scraper or a log reader can see (error
messages, fan-out answers keyed by worker, the ``worker`` label of /metrics, the
worker list) names the worker with its user info replaced by ``***``. Exception
texts are scrubbed as well, since an HTTP library may quote the URL it failed on.

``redact`` rewrites every ``scheme://userinfo@`` in a text, wherever it appears.
``RedactingFilter`` does the same to each log record that passes a handler (its
message, arguments and traceback), for the lines other modules log with a URL in
them; ``hicache router`` installs it on the root logger's handlers.
"""

from __future__ import annotations

import logging
import re

MASK = "***"
# scheme "://" userinfo "@": userinfo stops at what ends an authority or a quoted URL.
_USERINFO = re.compile(r"\b([A-Za-z][A-Za-z0-9+.\-]*://)[^\s/?#@'\"<>]+@")


def redact(text: str) -> str:
    """``text`` with the user info of every URL in it masked."""
    if "@" not in text:
        return text
    return _USERINFO.sub(rf"\g<1>{MASK}@", text)


class RedactingFilter(logging.Filter):
    """Masks URL credentials in a record's final message and traceback text."""

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            message = record.getMessage()
        except Exception:  # a malformed call: the handler reports it as it would have
            return True
        clean = redact(message)
        if clean != message:
            record.msg, record.args = clean, None
        if record.exc_info and not record.exc_text:
            record.exc_text = logging.Formatter().formatException(record.exc_info)
        if record.exc_text:
            record.exc_text = redact(record.exc_text)
        return True


def install_log_redaction(logger: logging.Logger | None = None) -> None:
    """Add a ``RedactingFilter`` to every handler of ``logger`` (default: the root's),
    once: every record a handler writes passes it, whichever logger it came from."""
    target = logger if logger is not None else logging.getLogger()
    for handler in target.handlers:
        if not any(isinstance(f, RedactingFilter) for f in handler.filters):
            handler.addFilter(RedactingFilter())
