"""A LiteLLM deployment's vacancy probe, as its `model_info` names it.

Read by the gateway's callback (integrations/litellm.py), which asks the probe before
routing, and by `vacancyd fleet --litellm-config` (fleet.py), which finds the lenders
there. One reading, so that both agree on what a config means.
"""

from __future__ import annotations

import os

import attrs

PROBE_KEY = "vacancy_probe"
TOKEN_KEY = "vacancy_token"
# LiteLLM's own spelling for a secret read from the environment.
FROM_ENVIRONMENT = "os.environ/"


@attrs.frozen
class Probe:
    url: str
    token: str | None


def probe_of(deployment: object) -> Probe | None:
    """The vacancy probe a deployment names in its `model_info`, if any; a token given as
    `os.environ/NAME` is read from the environment (None when it is not set)."""
    if not isinstance(deployment, dict):
        return None
    info = deployment.get("model_info")
    if not isinstance(info, dict):
        return None
    url = info.get(PROBE_KEY)
    if not isinstance(url, str) or not url:
        return None
    token = info.get(TOKEN_KEY)
    if isinstance(token, str) and token.startswith(FROM_ENVIRONMENT):
        token = os.environ.get(token.removeprefix(FROM_ENVIRONMENT))
    return Probe(url, token if isinstance(token, str) and token else None)
