"""Credentials inside URLs -- a password (`scheme://user:PASSWORD@host`) and a secret in a query
or fragment parameter (`?token=SECRET`, a presigned URL's `X-Amz-Signature=SECRET`): how to find
them, how to mask them, and a logging filter that masks them in every record a handler emits.

Configs refuse such URLs (schema.py), since Prefect stores a flow run's parameters as given; the
masking keeps the ones that come anyway -- a URL from the environment such as
$MLFLOW_TRACKING_URI, an exception message from a client library -- out of MLflow's params and
tags (tasks/tracking.py `redact`), of the console and of the log Prefect's API handler sends to
its server. Entry points install the filter once Prefect has set up its handlers
(`install_log_scrubber`); a Dask worker, whose handlers come with what its tasks import, masks
every record as it is made (`scrub_every_record`, tasks/data/on_workers.py).
"""

from __future__ import annotations

import logging
import re
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import TracebackType

REDACTED = "***"
# The user may be empty (`redis://:PASSWORD@host`); a path holding `@` has no `:` before it.
URL_PASSWORD = re.compile(r"(?<=://)([^/@:\s]*):([^/@\s]+)@")

# Parameters that carry a credential, by name, whatever the case: every kind of token (`token`,
# `access_token`, `X-Amz-Security-Token`, GitLab's `private_token`), password (libpq's and JDBC's
# `password`, `passwd`, `pwd`) and secret (`client_secret`); the signature of a presigned URL
# (`X-Amz-Signature`, S3's older `Signature`, `X-Goog-Signature`, Azure SAS's `sig`) and the
# credential it names (`X-Amz-Credential`, `X-Goog-Credential`); API keys (Google's `key`,
# `api_key`, `apikey`, `access_key`, Azure's `subscription-key`); Firebase's `auth`; a `jwt`.
# Names that merely end in `key` (`sort_key`) or start with `auth` (`authSource`) are no secret.
SECRET_NAME = (r"[\w.-]*(?:token|password|passwd|secret|signature|credentials?)"
               r"|(?:[\w.-]*[_.-])?(?:pwd|sig|auth|jwt)"
               r"|(?:api|access|secret|private|account|subscription|sas)?[_-]?key")
# A parameter starts after `?`, `&`, `;` or `#` (an OAuth token comes in the fragment), and its
# value runs to the next of them, a blank or a quote. Inside another URL's parameter the
# separators come percent-encoded (`%3F`, `%26`, `%3D`; `%253F` and so on once more per level of
# encoding): the value then runs to the next separator of its own level.
QUERY_SECRET = re.compile(
    rf"(?P<lead>[?&;#](?P<name>{SECRET_NAME})=)[^&;#\s'\"<>`]+"
    rf"|(?P<encoded>(?P<level>%(?:25)*)(?:3F|26|3B|23)(?P<encoded_name>{SECRET_NAME})(?P=level)3D)"
    r"(?:(?!(?P=level)(?:26|3B|23))[^&;#\s'\"<>`])+",
    re.IGNORECASE)


def scrub(text: str) -> str:
    """`text` with the password and the secret parameters of every URL in it replaced by `***`."""
    text = URL_PASSWORD.sub(rf"\1:{REDACTED}@", text)
    return QUERY_SECRET.sub(lambda m: (m["lead"] or m["encoded"]) + REDACTED, text)


def url_credential(text: str) -> str | None:
    """What in `text` holds a credential, as an error message names it, or None: the first URL
    password, else the first secret parameter."""
    if URL_PASSWORD.search(text):
        return "a password (its `user:password@` part)"
    found = QUERY_SECRET.search(text)
    if found is None:
        return None
    return f"a credential (its `{found['name'] or found['encoded_name']}` parameter)"


OSERROR_TEXTS = ("strerror", "filename", "filename2")  # an OSError's, outside its __dict__


def scrub_exception(err: BaseException) -> None:
    """Mask URL credentials, in place, in what `err` and the exceptions it was raised from or
    during say: their arguments and string attributes (an MlflowException's `message`, an
    OSError's `filename`) and notes. Prefect keeps a failed run's message, made from the
    exception, in its database and sends it to notifications; the log filter never sees it."""
    seen: set[int] = set()
    while err is not None and id(err) not in seen:  # a chain may loop back on itself
        seen.add(id(err))
        err.args = tuple(scrub(arg) if isinstance(arg, str) else arg for arg in err.args)
        for name in {*vars(err), *OSERROR_TEXTS}:
            value = getattr(err, name, None)
            if isinstance(value, str) and url_credential(value):
                setattr(err, name, scrub(value))
            elif name == "__notes__" and isinstance(value, list):
                value[:] = [scrub(note) if isinstance(note, str) else note for note in value]
        err = err.__cause__ or err.__context__


@contextmanager
def credentials_masked_in_errors() -> Iterator[None]:
    """An exception leaving the block is masked (scrub_exception) on its way out: the body of a
    Prefect task or flow, whose failed state keeps the exception's message."""
    try:
        yield
    except BaseException as err:
        scrub_exception(err)
        raise


class _ScrubbingExceptHook:
    """sys.excepthook: the exception masked (scrub_exception), then printed by the hook it replaced."""

    def __init__(self, printer: Callable[[type[BaseException], BaseException, TracebackType | None], None]):
        self.printer = printer

    def __call__(self, kind: type[BaseException], err: BaseException,
                 traceback: TracebackType | None) -> None:
        scrub_exception(err)
        self.printer(kind, err, traceback)


class ScrubURLCredentials(logging.Filter):
    """Masks URL credentials in a record's message and traceback; drops nothing."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if url_credential(message):
            record.msg, record.args = scrub(message), None
        if record.exc_info and not record.exc_text:
            record.exc_text = logging.Formatter().formatException(record.exc_info)
        if record.exc_text:
            record.exc_text = scrub(record.exc_text)
        if record.stack_info:
            record.stack_info = scrub(record.stack_info)
        return True


class _ScrubbingRecordFactory:
    """logging's record factory: each record masked (ScrubURLCredentials) as it is made."""

    def __init__(self, make: Callable[..., logging.LogRecord]):
        self.make = make

    def __call__(self, *args: object, **kwargs: object) -> logging.LogRecord:
        record = self.make(*args, **kwargs)
        try:
            ScrubURLCredentials().filter(record)
        except Exception:  # noqa: BLE001 -- arguments that do not format: logging reports it when it emits
            pass
        return record


def scrub_every_record() -> None:
    """Mask URL credentials in every log record this process makes from now on, whichever
    handler emits it: a Dask worker's handlers come and go with what its tasks import (Prefect
    sets up its own when the first task run arrives), after any filter could be installed."""
    factory = logging.getLogRecordFactory()
    if not isinstance(factory, _ScrubbingRecordFactory):
        logging.setLogRecordFactory(_ScrubbingRecordFactory(factory))


def install_log_scrubber() -> None:
    """Add the filter to every handler of every logger there is now (Prefect's console and API
    handlers included, once Prefect is imported); a handler that has it is left as it is. An
    exception no one catches is masked too before Python prints it (`sys.excepthook`): an entry
    point lists the errors it expects, never all."""
    if not isinstance(sys.excepthook, _ScrubbingExceptHook):
        sys.excepthook = _ScrubbingExceptHook(sys.excepthook)
    loggers = [logging.getLogger()] + [logger for logger in logging.Logger.manager.loggerDict.values()
                                       if isinstance(logger, logging.Logger)]
    for logger in loggers:
        for handler in logger.handlers:
            if not any(isinstance(f, ScrubURLCredentials) for f in handler.filters):
                handler.addFilter(ScrubURLCredentials())
