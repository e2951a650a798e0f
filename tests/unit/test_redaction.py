"""Credentials inside URLs (configs/redaction.py): a password and the secret parameters of a query
or fragment are masked in any text -- logs, MLflow params and tags, the errors a Prefect state
keeps -- and refused in configs."""

from __future__ import annotations

import io
import logging
import subprocess
import sys
from pathlib import Path

import pytest

from forgeline.configs import ConfigError, load_config
from forgeline.configs.redaction import (
    credentials_masked_in_errors,
    install_log_scrubber,
    scrub,
    scrub_every_record,
    url_credential,
)
from forgeline.tasks.stage import stage_named
from forgeline.tasks.tracking import redact, registry_input
from tests.conftest import debug_config

SECRET = "s3cr3tVALUE"

MASKED = [
    # (text holding SECRET, the same text masked)
    (f"https://h/data.jsonl?token={SECRET}", "https://h/data.jsonl?token=***"),
    (f"https://h/x?a=1&access_token={SECRET}&b=2", "https://h/x?a=1&access_token=***&b=2"),
    (f"http://127.0.0.1:5000/?TOKEN={SECRET}", "http://127.0.0.1:5000/?TOKEN=***"),
    (f"https://b.s3.amazonaws.com/k?X-Amz-Algorithm=AWS4-HMAC-SHA256&X-Amz-Credential={SECRET}%2F20240101"
     f"%2Fus-east-1%2Fs3%2Faws4_request&X-Amz-Date=20240101T000000Z&X-Amz-Expires=3600"
     f"&X-Amz-Security-Token={SECRET}%2B&X-Amz-SignedHeaders=host&X-Amz-Signature={SECRET}",
     "https://b.s3.amazonaws.com/k?X-Amz-Algorithm=AWS4-HMAC-SHA256&X-Amz-Credential=***"
     "&X-Amz-Date=20240101T000000Z&X-Amz-Expires=3600&X-Amz-Security-Token=***"
     "&X-Amz-SignedHeaders=host&X-Amz-Signature=***"),
    (f"https://b.s3.amazonaws.com/k?AWSAccessKeyId=AKIAEXAMPLE&Expires=1700000000&Signature={SECRET}%3D",
     "https://b.s3.amazonaws.com/k?AWSAccessKeyId=AKIAEXAMPLE&Expires=1700000000&Signature=***"),
    (f"https://storage.googleapis.com/b/o?X-Goog-Credential=sa%40p.iam&X-Goog-Signature={SECRET}",
     "https://storage.googleapis.com/b/o?X-Goog-Credential=***&X-Goog-Signature=***"),
    (f"https://a.blob.core.windows.net/c/blob?sv=2022-11-02&se=2030-01-01&sp=r&sig={SECRET}%2Fab%3D",
     "https://a.blob.core.windows.net/c/blob?sv=2022-11-02&se=2030-01-01&sp=r&sig=***"),
    (f"https://www.googleapis.com/storage/v1/b?key={SECRET}&alt=json",
     "https://www.googleapis.com/storage/v1/b?key=***&alt=json"),
    (f"https://h/api?api_key={SECRET}&apikey={SECRET}&Api-Key={SECRET}&subscription-key={SECRET}",
     "https://h/api?api_key=***&apikey=***&Api-Key=***&subscription-key=***"),
    (f"https://h/x?client_id=app&client_secret={SECRET}", "https://h/x?client_id=app&client_secret=***"),
    (f"postgresql://db:5432/mlflow?password={SECRET}&sslmode=require",
     "postgresql://db:5432/mlflow?password=***&sslmode=require"),
    (f"jdbc:sqlserver://db:1433;user=ml;password={SECRET};database=mlflow",
     "jdbc:sqlserver://db:1433;user=ml;password=***;database=mlflow"),
    (f"mysql://db/mlflow?user=ml&passwd={SECRET}", "mysql://db/mlflow?user=ml&passwd=***"),
    (f"mssql://db/mlflow?odbc_connect=DSN%3Dml%3BUID%3Dml%3BPWD%3D{SECRET}%3BEncrypt%3Dyes",
     "mssql://db/mlflow?odbc_connect=DSN%3Dml%3BUID%3Dml%3BPWD%3D***%3BEncrypt%3Dyes"),
    (f"https://app.firebaseio.com/x.json?auth={SECRET}", "https://app.firebaseio.com/x.json?auth=***"),
    # A fragment: OAuth's implicit flow returns the token there.
    (f"https://app/callback#access_token={SECRET}&token_type=bearer&expires_in=3600",
     "https://app/callback#access_token=***&token_type=bearer&expires_in=3600"),
    # The password and a parameter of one URL.
    (f"https://ml:{SECRET}@h/x?private_token={SECRET}", "https://ml:***@h/x?private_token=***"),
    # A URL inside another URL's parameter, percent-encoded once and twice.
    (f"https://h/login?next=https%3A%2F%2Fapp%2Fcb%3Faccess_token%3D{SECRET}%26state%3D1&lang=en",
     "https://h/login?next=https%3A%2F%2Fapp%2Fcb%3Faccess_token%3D***%26state%3D1&lang=en"),
    (f"https://h/?u=https%253A%252F%252Fa%252Fx%253Fsig%253D{SECRET}%2526sp%253Dr",
     "https://h/?u=https%253A%252F%252Fa%252Fx%253Fsig%253D***%2526sp%253Dr"),
    # Inside longer text and log lines: the value ends at a blank or a quote.
    (f"GET /api/v1/items?token={SECRET} HTTP/1.1 200", "GET /api/v1/items?token=*** HTTP/1.1 200"),
    (f"upload to 'https://h/c?sig={SECRET}' failed: 403", "upload to 'https://h/c?sig=***' failed: 403"),
    (f'{{"url": "https://h/c?jwt={SECRET}", "retries": 3}}', '{"url": "https://h/c?jwt=***", "retries": 3}'),
    (f"<a href=\"https://h/?token={SECRET}\">x</a>", "<a href=\"https://h/?token=***\">x</a>"),
    (f"two: https://a/?token={SECRET} and https://b/?sig={SECRET}.",
     "two: https://a/?token=*** and https://b/?sig=***"),
]


@pytest.mark.parametrize(("text", "masked"), MASKED)
def test_a_secret_in_a_url_is_masked_wherever_it_appears(text: str, masked: str) -> None:
    assert scrub(text) == masked
    assert SECRET not in scrub(text)
    assert scrub(masked) == masked  # masking twice changes nothing


@pytest.mark.parametrize("text", [
    "https://h/x?page=2&sort_key=name&authSource=admin&token_type=bearer&X-Amz-Date=20240101T000000Z",
    "https://h/x?token=&sig=",  # empty: nothing to hide
    "train.tokens_seen=1024 max_new_tokens=64 num_tokens=3",  # not in a query
    "s3://bucket/run@v2/checkpoints",
    "https://ml@mlflow.internal:5000/#section",
])
def test_urls_without_a_secret_are_left_as_they_are(text: str) -> None:
    assert scrub(text) == text
    assert url_credential(text) is None


@pytest.mark.parametrize(("text", "named"), [
    (f"https://h/x?a=1&X-Amz-Signature={SECRET}", "a credential (its `X-Amz-Signature` parameter)"),
    (f"https://h/?next=%3Fsig%3D{SECRET}", "a credential (its `sig` parameter)"),
    (f"https://u:{SECRET}@h/?token={SECRET}", "a password (its `user:password@` part)"),
])
def test_the_credential_found_is_named_not_quoted(text: str, named: str) -> None:
    assert url_credential(text) == named


def test_mlflow_params_and_tags_get_query_secrets_masked() -> None:
    """tasks/tracking.py `redact`, which every param and tag of a run goes through."""
    assert redact("data.sources", [{"path": f"https://h/x.jsonl?X-Amz-Signature={SECRET}"}]) == \
        [{"path": "https://h/x.jsonl?X-Amz-Signature=***"}]
    assert redact("forgeline.attempt.1.error", f"ConnectionError: cannot reach http://h/?token={SECRET}") == \
        "ConnectionError: cannot reach http://h/?token=***"


@pytest.mark.parametrize(("override", "field"), [
    (f"checkpoint.persistent_url=https://a.blob.core.windows.net/c?sv=2022-11-02&sig={SECRET}",
     "checkpoint.persistent_url"),
    (f"registry.tracking_uri=http://127.0.0.1:5000/?token={SECRET}", "registry.tracking_uri"),
    (f"data.sources=[{{kind: files, path: 'https://h/x.jsonl?X-Amz-Signature={SECRET}'}}]",
     "data.sources.0.path"),
])
def test_a_config_url_with_a_secret_parameter_is_refused_without_quoting_it(override: str,
                                                                           field: str) -> None:
    """As a URL password is: Prefect would store the config, secret and all, with the flow run."""
    with pytest.raises(ConfigError) as err:
        load_config("debug.yaml", [override])
    message = str(err.value)
    assert f"{field}: the URL holds a credential (its `" in message and "parameter)" in message
    assert SECRET not in message


def test_the_log_scrubber_masks_query_secrets_in_messages_and_tracebacks() -> None:
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    logger = logging.getLogger("forgeline.test_redaction")
    logger.addHandler(handler)
    try:
        install_log_scrubber()
        logger.warning("MLflow runs in %s", f"http://127.0.0.1:5000/?token={SECRET}")
        try:
            raise PermissionError(f"403 on https://b.s3.amazonaws.com/k?X-Amz-Signature={SECRET}")
        except PermissionError:
            logger.exception("download of %s failed", f"https://h/x?sig={SECRET}")
    finally:
        logger.removeHandler(handler)
    text = stream.getvalue()
    assert SECRET not in text
    assert "MLflow runs in http://127.0.0.1:5000/?token=***" in text
    assert "download of https://h/x?sig=*** failed" in text
    assert "PermissionError: 403 on https://b.s3.amazonaws.com/k?X-Amz-Signature=***" in text


def test_every_record_made_is_masked_whichever_handler_comes_later() -> None:
    """A Dask worker's way: its handlers come with what its tasks import, after setup."""
    factory = logging.getLogRecordFactory()
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    logger = logging.getLogger("forgeline.test_redaction.later")
    try:
        scrub_every_record()
        logger.addHandler(handler)  # no filter of its own
        logger.warning("reading %s", f"s3://AKIA:{SECRET}@bucket/pages")
    finally:
        logger.removeHandler(handler)
        logging.setLogRecordFactory(factory)
    assert stream.getvalue().startswith("reading s3://AKIA:***@bucket/pages\n")
    assert SECRET not in stream.getvalue()


def test_an_error_leaving_a_task_is_masked_with_the_errors_it_came_from() -> None:
    from mlflow.exceptions import MlflowException

    with pytest.raises(RuntimeError) as raised, credentials_masked_in_errors():
        try:
            try:
                raise OSError(2, "No such file", f"https://h/x?sig={SECRET}")
            except OSError as err:
                raise MlflowException(f"API request to http://u:{SECRET}@h/ failed") from err
        except MlflowException as err:
            err.add_note(f"while reading https://h/?token={SECRET}")
            raise RuntimeError(f"stage failed: {err}") from err
    chain = [raised.value, raised.value.__cause__, raised.value.__cause__.__cause__]
    assert "http://u:***@h/" in str(chain[0]) and chain[1].message == "API request to http://u:***@h/ failed"
    assert chain[2].filename == "https://h/x?sig=***" and chain[1].__notes__ == ["while reading https://h/?token=***"]
    assert SECRET not in "".join(str(err) + repr(vars(err)) for err in chain)


def test_an_error_main_does_not_list_is_printed_masked() -> None:
    """A verb raising what `forgeline`'s main does not catch: Python's own traceback, masked."""
    verb = ("import sys\nfrom forgeline.flows import cli\n"
            "def fails(args):\n"
            f"    raise ConnectionRefusedError('connecting to https://forgeline:{SECRET}@mlflow.example.com')\n"
            "cli.VERBS['status'] = fails\nsys.exit(cli.main(['status']))\n")
    done = subprocess.run([sys.executable, "-c", verb], capture_output=True, text=True, timeout=300)
    assert done.returncode == 1 and "Traceback" in done.stderr, done.stderr
    assert SECRET not in done.stderr
    assert "ConnectionRefusedError: connecting to https://forgeline:***@mlflow.example.com" in done.stderr


def test_the_register_stages_stamp_holds_no_credential_of_the_tracking_uri(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"https://forgeline:{SECRET}@mlflow.example.com")
    cfg = debug_config(tmp_path, "registry.tracking_uri=null")
    # The register stage's external input, which its stamp records among its inputs.
    assert stage_named("register").external == "forgeline.tasks.tracking:registry_input"
    assert registry_input(cfg) == {"tracking_uri": "https://forgeline:***@mlflow.example.com"}
