"""A failed flow run posts to the notification block its config names: a real
CustomWebhookNotificationBlock saved in a real (temporary) Prefect API, posting to an HTTP
server on 127.0.0.1."""

from __future__ import annotations

from pathlib import Path

import pytest
from prefect.blocks.notifications import CustomWebhookNotificationBlock
from prefect.testing.utilities import prefect_test_harness

from forgeline.flows.stage_flows import eval_flow
from tests.conftest import output_overrides

# prefect_test_harness is the API here, as for a machine with no server of its own.
pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.usefixtures("temporary_prefect_api")]


def test_a_failed_stage_flow_posts_to_the_configured_block(tmp_path: Path,
                                                           webhook: tuple[str, list[dict]]) -> None:
    url, received = webhook
    with prefect_test_harness(server_startup_timeout=180):  # 30 s by default: too short on 2 busy cores
        CustomWebhookNotificationBlock(name="forgeline", url=url, allow_private_urls=True,
                                       json_data={"text": "{{subject}} | {{body}}"}).save("alerts")
        # No train output under tmp_path: the eval stage fails.
        overrides = [*output_overrides(tmp_path), "ops.notify_block=custom-webhook/alerts"]
        with pytest.raises(FileNotFoundError):
            eval_flow(config="debug.yaml", overrides=overrides)
    [posted] = received
    assert posted["text"].startswith("forgeline: forgeline-eval run ") and "failed" in posted["text"]
    assert "FAILED" in posted["text"]
