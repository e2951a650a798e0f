"""Passwords inside URLs (`scheme://user:PASSWORD@host`): how to find them, and a logging filter
that masks them in every record a handler emits.

Configs refuse such URLs (schema.py), since Prefect stores a flow run's parameters as given; the
filter keeps the ones that reach a log anyway -- a URL from the environment such as
$MLFLOW_TRACKING_URI, an exception message from a client library -- out of the console and of
the log Prefect's API handler sends to its server. Entry points install it once Prefect has set
up its handlers (`install_log_scrubber`).
"""

from __future__ import annotations

import logging
import re

REDACTED = "***"
# The user may be empty (`redis://:PASSWORD@host`); a path holding `@` has no `:` before it.
URL_PASSWORD = re.compile(r"(?<=://)([^/@:\s]*):([^/@\s]+)@")


def scrub(text: str) -> str:
    """`text` with the password of every URL in it replaced by `***`."""
    return URL_PASSWORD.sub(rf"\1:{REDACTED}@", text)


class ScrubURLPasswords(logging.Filter):
    """Masks URL passwords in a record's message and traceback; drops nothing."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if URL_PASSWORD.search(message):
            record.msg, record.args = scrub(message), None
        if record.exc_info and not record.exc_text:
            record.exc_text = logging.Formatter().formatException(record.exc_info)
        if record.exc_text:
            record.exc_text = scrub(record.exc_text)
        if record.stack_info:
            record.stack_info = scrub(record.stack_info)
        return True


def install_log_scrubber() -> None:
    """Add the filter to every handler of every logger there is now (Prefect's console and API
    handlers included, once Prefect is imported); a handler that has it is left as it is."""
    loggers = [logging.getLogger()] + [logger for logger in logging.Logger.manager.loggerDict.values()
                                       if isinstance(logger, logging.Logger)]
    for logger in loggers:
        for handler in logger.handlers:
            if not any(isinstance(f, ScrubURLPasswords) for f in handler.filters):
                handler.addFilter(ScrubURLPasswords())
