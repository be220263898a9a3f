"""A LiteLLM deployment's vacancy probe, as its `model_info` names it.

Read by the gateway's callback (integrations/litellm.py), which asks the probe before
routing, and by `vacancyd fleet --litellm-config` (fleet.py), which finds the lenders
there. One reading, so that both agree on what a config means.
"""

from __future__ import annotations

import os
from urllib.parse import urlencode

import attrs

PROBE_KEY = "vacancy_probe"
TOKEN_KEY = "vacancy_token"
# The model name the lender's server knows, where it differs from the deployment's.
MODEL_KEY = "vacancy_model"
# LiteLLM's own spelling for a secret read from the environment.
FROM_ENVIRONMENT = "os.environ/"


@attrs.frozen
class Probe:
    url: str
    token: str | None
    # The model the deployment sends to the lender; the probe is asked about it.
    model: str | None = None

    @property
    def asks(self) -> str:
        """The probe's URL with the model as its question (`?model=`), when there is one."""
        if self.model is None:
            return self.url
        joiner = "&" if "?" in self.url else "?"
        return f"{self.url}{joiner}{urlencode({'model': self.model})}"


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
    return Probe(url, token if isinstance(token, str) and token else None, _model_of(deployment))


def _model_of(deployment: dict[object, object]) -> str | None:
    """The name the lender's server is asked for: `model_info.vacancy_model`, else
    LiteLLM's `litellm_params.model` less its provider (`openai/gemma3` asks for
    `gemma3`, `ollama/llama3.2:3b` for `llama3.2:3b`)."""
    info = deployment.get("model_info")
    named = info.get(MODEL_KEY) if isinstance(info, dict) else None
    if isinstance(named, str) and named:
        return named
    params = deployment.get("litellm_params")
    model = params.get("model") if isinstance(params, dict) else None
    if not isinstance(model, str) or not model:
        return None
    _, slash, rest = model.partition("/")
    return rest if slash and rest else model
