"""Configuration: the schema, and a strict loader that names the key path of every problem."""

from vacancyd.config.addresses import HostPort, Target, is_loopback_host, parse_listen, parse_target
from vacancyd.config.load import default_config_text, load_config, parse_config, resolve_state_dir
from vacancyd.config.schema import (
    AdapterName,
    AuthConfig,
    Config,
    LendingWindow,
    LimitsConfig,
    Management,
    OnOwnerReturn,
    OwnerConfig,
    PresenceBackend,
    PressureConfig,
    ResourceConfig,
    Scope,
    ServerConfig,
    TokenConfig,
    UpstreamConfig,
)

__all__ = [
    "AdapterName",
    "AuthConfig",
    "Config",
    "HostPort",
    "LendingWindow",
    "LimitsConfig",
    "Management",
    "OnOwnerReturn",
    "OwnerConfig",
    "PresenceBackend",
    "PressureConfig",
    "ResourceConfig",
    "Scope",
    "ServerConfig",
    "Target",
    "TokenConfig",
    "UpstreamConfig",
    "default_config_text",
    "is_loopback_host",
    "load_config",
    "parse_config",
    "parse_listen",
    "parse_target",
    "resolve_state_dir",
]
