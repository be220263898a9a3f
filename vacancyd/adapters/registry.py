"""Adapter lookup by the name used in `[[upstream]] adapter = ...`."""

from __future__ import annotations

from vacancyd.adapters.base import Adapter
from vacancyd.adapters.chatterbox import CHATTERBOX
from vacancyd.adapters.comfyui import COMFYUI
from vacancyd.adapters.llamacpp import LLAMACPP
from vacancyd.adapters.ollama import OLLAMA
from vacancyd.adapters.openai import OPENAI

_ADAPTERS = {adapter.name: adapter for adapter in (OPENAI, LLAMACPP, OLLAMA, COMFYUI, CHATTERBOX)}


def adapter_for(name: str) -> Adapter:
    return _ADAPTERS[name]


def adapter_names() -> list[str]:
    """Every registered adapter's name, for tests and docs that walk all of them."""
    return sorted(_ADAPTERS)
