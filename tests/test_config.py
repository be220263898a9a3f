"""The strict config loader: what loads, what is refused, and how each problem is named."""

from __future__ import annotations

import re
import textwrap
import tomllib
from pathlib import Path

import attrs
import pytest

from tests.support.configs import BASIC, config_from
from vacancyd.cli import main
from vacancyd.config import (
    AdapterName,
    Config,
    Management,
    OnOwnerReturn,
    PresenceBackend,
    Scope,
    Target,
    load_config,
    parse_config,
    parse_listen,
    schema,
)
from vacancyd.errors import ConfigError
from vacancyd.model import OwnerScope, ResourceKind

REPO = Path(__file__).resolve().parent.parent
EXAMPLE = REPO / "conf" / "vacancyd.example.toml"
DIGEST = "ab" * 32

# Quoted from DESIGN.md ("This minimal file must always load and run as written").
DESIGN_MINIMAL = """\
[server]
api_listen = "127.0.0.1:9460"
state_dir = "/var/lib/vacancyd"

[owner]
presence = "headless"          # or "logind", "auto"

[[resource]]
name = "ram"
kind = "memory"                # "memory" | "cpu" | "nvidia_gpu"

[[resource]]
name = "gpu0"
kind = "nvidia_gpu"
device = 0                     # index, or "0000:01:00.0", or "GPU-<uuid>"

[[upstream]]
name = "llama"
adapter = "llamacpp"           # "ollama" | "openai" | "llamacpp" | "comfyui" | "chatterbox"
listen = "127.0.0.1:8081"
target = "http://127.0.0.1:8080"
resource = "gpu0"
also_requires = ["ram"]
"""

RESOURCES = """\
[[resource]]
name = "ram"
kind = "memory"

[[resource]]
name = "cpu"
kind = "cpu"

[[resource]]
name = "gpu0"
kind = "nvidia_gpu"
device = 0
"""


def upstream(name: str = "u", listen: str = "127.0.0.1:8081", **extra: str) -> str:
    """One [[upstream]] table; `extra` values are TOML source, written as given."""
    lines = [
        "[[upstream]]",
        f'name = "{name}"',
        'adapter = "ollama"',
        f'listen = "{listen}"',
        'target = "http://127.0.0.1:8080"',
        'resource = "gpu0"',
    ]
    lines += [f"{key} = {value}" for key, value in extra.items()]
    return "\n".join(lines) + "\n"


def token(name: str, scopes: str, body: str = f'sha256 = "{DIGEST}"') -> str:
    return f'[[auth.tokens]]\nname = "{name}"\nscopes = {scopes}\n{body}\n'


def problems(text: str) -> list[str]:
    with pytest.raises(ConfigError) as caught:
        parse_config(textwrap.dedent(text))
    assert str(caught.value) == "\n".join(caught.value.messages)
    return caught.value.messages


def only_problem(text: str) -> str:
    messages = problems(text)
    assert len(messages) == 1, messages
    return messages[0]


# --- files that must load ----------------------------------------------------------------


def test_embedded_default_loads_loopback_only() -> None:
    config = load_config(None)
    assert config.server.api_listen == "127.0.0.1:9460"
    assert [(r.name, r.kind) for r in config.resource] == [
        ("ram", ResourceKind.MEMORY),
        ("cpu", ResourceKind.CPU),
    ]
    [ollama] = config.upstream
    assert (ollama.name, ollama.adapter) == ("ollama", AdapterName.OLLAMA)
    assert (ollama.resource, ollama.also_requires) == ("ram", ["cpu"])
    assert parse_listen(ollama.listen).is_loopback
    assert parse_listen(config.server.api_listen).is_loopback
    assert config.auth.tokens == []


def test_empty_file_is_all_defaults() -> None:
    assert parse_config("") == Config()


def test_design_minimal_file_loads_as_written() -> None:
    config = parse_config(DESIGN_MINIMAL)
    assert config.server.state_dir == "/var/lib/vacancyd"
    assert config.owner.presence is PresenceBackend.HEADLESS
    gpu = config.resource_named("gpu0")
    assert (gpu.kind, gpu.device) == (ResourceKind.NVIDIA_GPU, 0)
    [llama] = config.upstream
    assert llama.adapter is AdapterName.LLAMACPP
    assert (llama.resource, llama.also_requires) == ("gpu0", ["ram"])
    # Everything not written takes its default.
    assert llama.on_owner_return is OnOwnerReturn.DRAIN
    assert llama.owner_scope is OwnerScope.HOST
    assert llama.management is Management.DENY


def test_example_file_loads() -> None:
    config = load_config(EXAMPLE)
    assert [r.name for r in config.resource] == ["ram", "cpu", "gpu0"]
    gpu = config.resource_named("gpu0")
    assert gpu.pressure is not None
    assert gpu.pressure.threshold_pct is None  # learned, as the example explains
    by_name = {t.name: t for t in config.auth.tokens}
    assert by_name["owner-admin"].file == "/etc/vacancyd/admin.token"
    assert by_name["owner-admin"].sha256 is None
    assert by_name["cluster-borrower"].scopes == [Scope.BORROW]
    assert re.fullmatch(r"[0-9a-f]{64}", by_name["cluster-borrower"].sha256 or "")
    ollama = config.upstream[0]
    assert set(ollama.default_need_mib) == {"gpu0", "ram"}
    assert set(ollama.models) == {"llama3.1:8b", "qwen2.5:14b"}


def test_example_listens_on_loopback_only() -> None:
    config = load_config(EXAMPLE)
    listens = [config.server.api_listen, *(u.listen for u in config.upstream)]
    assert all(parse_listen(text).is_loopback for text in listens)
    assert all(u.target.startswith("http://127.0.0.1:") for u in config.upstream)
    assert config.auth.allow_unauthenticated_remote is False


def test_example_documents_every_key_of_the_schema() -> None:
    text = EXAMPLE.read_text("utf-8")
    classes = [
        obj
        for obj in vars(schema).values()
        if isinstance(obj, type) and attrs.has(obj) and obj.__module__ == schema.__name__
    ]
    assert len(classes) == 12
    # A field whose TOML key is a Python keyword (`from`) names its key in its metadata.
    keys = {
        f"{cls.__name__}.{field.name}": field.metadata.get("key", field.name)
        for cls in classes
        for field in attrs.fields(cls)
    }
    missing = sorted(
        where
        for where, key in keys.items()
        # Set, or shown commented out where leaving it unset is the point.
        if not re.search(rf"^(# )?{key} = ", text, re.MULTILINE)
        and f"[{key}" not in text
        and f".{key}]" not in text
        and f".{key}." not in text
    )
    assert missing == []


def test_int_is_accepted_where_a_float_is_wanted() -> None:
    config = parse_config("[server]\npoll_interval_s = 3\n")
    assert config.server.poll_interval_s == 3.0
    assert type(config.server.poll_interval_s) is float


@pytest.mark.parametrize("device", ["1", '"0000:01:00.0"', '"GPU-5c2f0a1e-7b4d"'])
def test_gpu_device_by_index_bus_id_or_uuid(device: str) -> None:
    config = parse_config(f'[[resource]]\nname = "g"\nkind = "nvidia_gpu"\ndevice = {device}\n')
    assert config.resource[0].device == tomllib.loads(f"d = {device}")["d"]


# --- strict scalars, unknown keys, missing keys -----------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ('[server]\napi_listn = "127.0.0.1:1"\n', "server: unknown key(s): api_listn"),
        ("colour = 1\n", "(top level): unknown key(s): colour"),
        ("[server.limits]\nmax_body = 1\n", "server.limits: unknown key(s): max_body"),
        ("[servr]\n", "(top level): unknown key(s): servr"),
        (
            RESOURCES.replace("device = 0", "device = 0\n[resource.pressure]\nthreshold = 5"),
            "resource[2].pressure: unknown key(s): threshold",
        ),
        (
            RESOURCES + "max_temperature_c = 83\n[resource.heat]\nmargin_c = 5",
            "resource[2].heat: unknown key(s): margin_c",
        ),
        (
            token("t", '["read"]') + "scope = 1\n",
            "auth.tokens[0]: unknown key(s): scope",
        ),
    ],
)
def test_unknown_key_is_named_with_its_path(text: str, expected: str) -> None:
    assert only_problem(text) == expected


def test_several_unknown_keys_in_one_table_are_listed_together() -> None:
    message = only_problem("[owner]\nzeta = 1\nalpha = 2\n")
    assert message == "owner: unknown key(s): alpha, zeta"


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ('[auth]\ntrust_loopback = "false"', "auth.trust_loopback: expected true or false"),
        ("[owner]\nlend_when_idle = 0", "owner.lend_when_idle: expected true or false, got 0"),
        (
            RESOURCES + 'enabled = "false"',
            "resource[2].enabled: expected true or false, got 'false'",
        ),
        (
            RESOURCES + upstream(yield_on_veto='"no"'),
            "upstream[0].yield_on_veto: expected true or false, got 'no'",
        ),
    ],
)
def test_a_string_or_number_is_not_a_bool(text: str, expected: str) -> None:
    assert only_problem(text).startswith(expected)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (
            "[server.limits]\nmax_request_body_mib = 80.9",
            "server.limits.max_request_body_mib: expected an integer, got 80.9",
        ),
        (
            "[server.limits]\nmax_request_body_mib = 80.0",
            "server.limits.max_request_body_mib: expected an integer, got 80.0",
        ),
        (
            '[server.limits]\nmax_request_body_mib = "80"',
            "server.limits.max_request_body_mib: expected an integer, got '80'",
        ),
        (
            "[server.limits]\nmax_connections = true",
            "server.limits.max_connections: expected an integer, got True",
        ),
        (
            RESOURCES + "keep_free_mib = 1024.5",
            "resource[2].keep_free_mib: expected an integer, got 1024.5",
        ),
        (
            RESOURCES + "[resource.pressure]\npoll_ms = 1000.5",
            "resource[2].pressure.poll_ms: expected an integer, got 1000.5",
        ),
        (
            '[server]\npoll_interval_s = "3"',
            "server.poll_interval_s: expected a number, got '3'",
        ),
        (
            "[owner]\nrelease_after_s = true",
            "owner.release_after_s: expected a number, got True",
        ),
        ("[server]\napi_listen = 9460", "server.api_listen: expected a string, got 9460"),
        (
            RESOURCES.replace("device = 0", "device = true"),
            "resource[2].device: expected an index or an identity string, got True",
        ),
    ],
)
def test_scalars_are_strict(text: str, expected: str) -> None:
    assert only_problem(text) == expected


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ('[owner]\npresence = "systemd"', "owner.presence: 'systemd' is not a valid"),
        ('[server]\nlog_level = "INFO"', "server.log_level: 'INFO' is not a valid"),
        (
            RESOURCES + upstream(on_owner_return='"wait"'),
            "upstream[0].on_owner_return: 'wait' is not a valid",
        ),
        (
            token("t", '["borrow", "root"]'),
            "auth.tokens[0].scopes[1]: 'root' is not a valid",
        ),
    ],
)
def test_unknown_choice_is_named_with_its_path(text: str, expected: str) -> None:
    assert only_problem(text).startswith(expected)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ('[[resource]]\nkind = "memory"\n', "resource[0].name: required key is missing"),
        ('[[resource]]\nname = "ram"\n', "resource[0].kind: required key is missing"),
        (
            RESOURCES + upstream().replace('target = "http://127.0.0.1:8080"\n', ""),
            "upstream[0].target: required key is missing",
        ),
        (
            f'[[auth.tokens]]\nname = "t"\nsha256 = "{DIGEST}"\n',
            "auth.tokens[0].scopes: required key is missing",
        ),
    ],
)
def test_missing_required_key_is_named_with_its_path(text: str, expected: str) -> None:
    assert only_problem(text) == expected


def test_several_problems_are_reported_in_one_error() -> None:
    messages = problems(
        """\
        [server]
        api_listn = "127.0.0.1:9460"
        poll_interval_s = "fast"

        [[resource]]
        kind = "memory"

        [[resource]]
        name = "gpu0"
        kind = "gpu"
        """
    )
    assert sorted(messages) == [
        "resource[0].name: required key is missing",
        "resource[1].kind: 'gpu' is not a valid ResourceKind",
        "server.poll_interval_s: expected a number, got 'fast'",
        "server: unknown key(s): api_listn",
    ]


def test_range_and_cross_field_problems_are_reported_together() -> None:
    messages = problems(
        RESOURCES
        + "[server]\npoll_interval_s = 0\n"
        + upstream(also_requires='["disk"]', drain_timeout_s="-5")
    )
    assert sorted(messages) == [
        "server.poll_interval_s: must be greater than 0, got 0.0",
        "upstream[0].also_requires[0]: unknown resource 'disk'",
        "upstream[0].drain_timeout_s: must be at least 0, got -5.0",
    ]


def test_wrong_kind_of_table_is_reported_with_its_path() -> None:
    assert only_problem("resource = 5\n") == "resource: expected a list, got 5"


# --- ranges ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (
            "[server]\npoll_interval_s = 0",
            "server.poll_interval_s: must be greater than 0, got 0.0",
        ),
        ("[server]\nshutdown_grace_s = -1", "server.shutdown_grace_s: must be greater than 0"),
        ("[owner]\nrelease_after_s = -1", "owner.release_after_s: must be at least 0, got -1.0"),
        (
            "[server.limits]\nmax_connections = 0",
            "server.limits.max_connections: must be at least 1, got 0",
        ),
        (
            "[server.limits]\nmax_buffered_body_mib = 0",
            "server.limits.max_buffered_body_mib: must be greater than 0, got 0",
        ),
        (
            "[server.limits]\nbody_idle_timeout_s = 0.0",
            "server.limits.body_idle_timeout_s: must be greater than 0, got 0.0",
        ),
        (
            RESOURCES + "keep_free_mib = -1",
            "resource[2].keep_free_mib: must be at least 0, got -1",
        ),
        (
            RESOURCES + "[resource.pressure]\npoll_ms = 50",
            "resource[2].pressure.poll_ms: must be at least 100, got 50",
        ),
        (
            RESOURCES + "[resource.pressure]\nrelease_after_s = -1",
            "resource[2].pressure.release_after_s: must be at least 0, got -1.0",
        ),
        (
            RESOURCES + upstream(completion_timeout_s="0"),
            "upstream[0].completion_timeout_s: must be greater than 0, got 0.0",
        ),
        (
            RESOURCES + upstream(resident_min_free_mib="-1"),
            "upstream[0].resident_min_free_mib: must be at least 0, got -1",
        ),
        (
            RESOURCES + upstream(default_need_mib="{ gpu0 = -100 }"),
            'upstream[0].default_need_mib."gpu0": must be at least 0, got -100',
        ),
        (
            RESOURCES + "max_utilization_pct = 101.0",
            "resource[2].max_utilization_pct: must be at most 100",
        ),
        (
            RESOURCES + "[resource.pressure]\nthreshold_pct = 40.0\ncap_pct = 30.0",
            "resource[2].pressure.threshold_pct: must not exceed cap_pct (30)",
        ),
        (
            RESOURCES + "max_temperature_c = 0",
            "resource[2].max_temperature_c: must be greater than 0, got 0.0",
        ),
        (
            RESOURCES + "max_temperature_c = 83\n[resource.heat]\nrelease_after_s = -1",
            "resource[2].heat.release_after_s: must be at least 0, got -1.0",
        ),
        (
            RESOURCES + "max_temperature_c = 83\n[resource.heat]\nrelease_margin_c = -0.5",
            "resource[2].heat.release_margin_c: must be at least 0, got -0.5",
        ),
        (
            RESOURCES + "max_temperature_c = 10\n[resource.heat]\nrelease_margin_c = 10",
            "resource[2].heat.release_margin_c: must be less than max_temperature_c (10)",
        ),
    ],
)
def test_range_problem_carries_its_key_path(text: str, expected: str) -> None:
    assert only_problem(text).startswith(expected)


def test_zero_is_fine_where_the_bound_is_inclusive() -> None:
    config = parse_config(
        RESOURCES + "[owner]\nrelease_after_s = 0\n" + upstream(drain_timeout_s="0")
    )
    assert config.owner.release_after_s == 0.0
    assert config.upstream[0].drain_timeout_s == 0.0


# --- cross-field rules: listeners and tokens ----------------------------------------------


def test_remote_upstream_without_a_borrow_token_is_refused() -> None:
    message = only_problem(RESOURCES + upstream(listen="0.0.0.0:8081"))
    assert message == (
        "upstream[0].listen: listens beyond loopback but no token has the borrow scope; "
        "add [[auth.tokens]] or set auth.allow_unauthenticated_remote = true"
    )


def test_remote_upstream_with_only_a_read_token_is_refused() -> None:
    message = only_problem(
        RESOURCES + token("ops", '["read", "admin"]') + upstream(listen="192.0.2.7:8081")
    )
    assert message.startswith("upstream[0].listen: listens beyond loopback but no token")


def test_remote_upstream_with_a_borrow_token_loads() -> None:
    config = parse_config(RESOURCES + token("b", '["borrow"]') + upstream(listen="[::]:8081"))
    assert config.upstream[0].listen == "[::]:8081"


def test_remote_api_without_read_or_admin_token_is_refused() -> None:
    message = only_problem('[server]\napi_listen = "0.0.0.0:9460"\n' + token("b", '["borrow"]'))
    assert message == (
        "server.api_listen: listens beyond loopback but no token has the read or admin "
        "scope; add [[auth.tokens]] or set auth.allow_unauthenticated_remote = true"
    )


@pytest.mark.parametrize("scopes", ['["read"]', '["admin"]'])
def test_remote_api_with_read_or_admin_token_loads(scopes: str) -> None:
    config = parse_config('[server]\napi_listen = "0.0.0.0:9460"\n' + token("ops", scopes))
    assert config.server.api_listen == "0.0.0.0:9460"


def test_allow_unauthenticated_remote_lifts_both_rules() -> None:
    text = '[server]\napi_listen = "0.0.0.0:9460"\n' + RESOURCES + upstream(listen="0.0.0.0:8081")
    assert len(problems(text)) == 2
    config = parse_config(text + "[auth]\nallow_unauthenticated_remote = true\n")
    assert config.auth.allow_unauthenticated_remote is True


@pytest.mark.parametrize("host", ["127.0.0.1", "127.8.9.10", "[::1]", "localhost"])
def test_loopback_listeners_need_no_token(host: str) -> None:
    config = parse_config(
        f'[server]\napi_listen = "{host}:9460"\n' + RESOURCES + upstream(listen=f"{host}:8081")
    )
    assert config.auth.tokens == []


def test_duplicate_listen_between_two_upstreams() -> None:
    message = only_problem(RESOURCES + upstream("a") + upstream("b"))
    assert message == "upstream[1].listen: 127.0.0.1:8081 is already used by upstream[0].listen"


def test_duplicate_listen_between_api_and_an_upstream() -> None:
    message = only_problem(RESOURCES + upstream(listen="127.0.0.1:9460"))
    assert message == "upstream[0].listen: 127.0.0.1:9460 is already used by server.api_listen"


def test_port_zero_may_repeat() -> None:
    config = parse_config(
        '[server]\napi_listen = "127.0.0.1:0"\n'
        + RESOURCES
        + upstream("a", listen="127.0.0.1:0")
        + upstream("b", listen="127.0.0.1:0")
    )
    assert [u.listen for u in config.upstream] == ["127.0.0.1:0", "127.0.0.1:0"]


@pytest.mark.parametrize("other", ["localhost:8081", "0.0.0.0:8081"])
def test_same_port_under_another_spelling_is_a_duplicate(other: str) -> None:
    text = RESOURCES + upstream("a") + upstream("b", listen=other)
    text += "[auth]\nallow_unauthenticated_remote = true\n"
    assert "is already used by upstream[0].listen" in only_problem(text)


@pytest.mark.parametrize(
    ("listen", "expected"),
    [
        ("127.0.0.1", "upstream[0].listen: expected host:port, got '127.0.0.1'"),
        ("127.0.0.1:99999", "upstream[0].listen: port must be a number from 0 to 65535"),
        ("example.com:80", "upstream[0].listen: listen host must be an IP address or localhost"),
    ],
)
def test_bad_listen_address(listen: str, expected: str) -> None:
    assert only_problem(RESOURCES + upstream(listen=listen)).startswith(expected)


def test_bad_target_is_named() -> None:
    message = only_problem(RESOURCES + upstream().replace("http://127.0.0.1:8080", "ftp://x"))
    assert message == "upstream[0].target: target must be an http:// or https:// URL, got 'ftp://x'"


def test_upstream_names_must_differ() -> None:
    text = RESOURCES + upstream("a") + upstream("a", listen="127.0.0.1:8082")
    assert only_problem(text) == "upstream[1].name: upstream 'a' is declared twice"


# --- cross-field rules: resources and footprints --------------------------------------------


def test_resource_names_must_differ() -> None:
    text = RESOURCES + '[[resource]]\nname = "ram"\nkind = "memory"\n'
    assert only_problem(text) == "resource[3].name: resource 'ram' is declared twice"


def test_unknown_primary_resource() -> None:
    text = RESOURCES + upstream().replace('resource = "gpu0"', 'resource = "gpu1"')
    assert only_problem(text) == "upstream[0].resource: unknown resource 'gpu1'"


def test_unknown_resource_in_also_requires() -> None:
    text = RESOURCES + upstream(also_requires='["ram", "swap"]')
    assert only_problem(text) == "upstream[0].also_requires[1]: unknown resource 'swap'"


@pytest.mark.parametrize(
    ("also", "expected"),
    [
        ('["ram", "ram"]', "upstream[0].also_requires[1]: resource 'ram' is listed twice"),
        ('["gpu0"]', "upstream[0].also_requires[0]: resource 'gpu0' is listed twice"),
    ],
)
def test_resource_listed_twice(also: str, expected: str) -> None:
    assert only_problem(RESOURCES + upstream(also_requires=also)) == expected


def test_default_need_naming_a_resource_the_upstream_does_not_use() -> None:
    text = RESOURCES + upstream(default_need_mib="{ ram = 1024 }")
    assert only_problem(text) == (
        'upstream[0].default_need_mib."ram": not one of this upstream\'s resources (gpu0)'
    )


def test_model_need_naming_a_resource_the_upstream_does_not_use() -> None:
    text = RESOURCES + upstream(also_requires='["cpu"]')
    text += '[upstream.models."llama3"]\nneed_mib = { gpu0 = 6000, ram = 512 }\n'
    assert only_problem(text) == (
        'upstream[0].models."llama3".need_mib."ram": '
        "not one of this upstream's resources (cpu, gpu0)"
    )


def test_need_on_a_cpu_resource_is_refused() -> None:
    text = RESOURCES + upstream(also_requires='["cpu"]', default_need_mib="{ cpu = 4 }")
    assert only_problem(text) == (
        'upstream[0].default_need_mib."cpu": a cpu resource has no MiB to charge'
    )


def test_needs_on_the_upstreams_own_resources_load() -> None:
    text = RESOURCES + upstream(also_requires='["ram"]', default_need_mib="{ gpu0 = 1, ram = 2 }")
    text += '[upstream.models."m"]\nneed_mib = { gpu0 = 3 }\n'
    [loaded] = parse_config(text).upstream
    assert loaded.default_need_mib == {"gpu0": 1, "ram": 2}
    assert loaded.models["m"].need_mib == {"gpu0": 3}


def test_device_is_required_for_an_nvidia_gpu() -> None:
    text = '[[resource]]\nname = "gpu0"\nkind = "nvidia_gpu"\n'
    assert only_problem(text) == (
        "resource[0].device: required for an nvidia_gpu (an index, PCI bus id or UUID)"
    )


@pytest.mark.parametrize("kind", ["memory", "cpu"])
def test_device_is_refused_on_other_kinds(kind: str) -> None:
    text = f'[[resource]]\nname = "r"\nkind = "{kind}"\ndevice = 0\n'
    assert only_problem(text) == "resource[0].device: only an nvidia_gpu resource names a device"


def test_pressure_is_refused_on_a_non_gpu() -> None:
    text = '[[resource]]\nname = "ram"\nkind = "memory"\n[resource.pressure]\ncap_pct = 20.0\n'
    assert only_problem(text) == (
        "resource[0].pressure: pressure is attributed for nvidia_gpu resources only"
    )


def test_a_heat_guard_is_off_unless_max_temperature_is_set() -> None:
    gpu = parse_config(RESOURCES).resource[2]
    assert (gpu.max_temperature_c, gpu.heat) == (None, None)


def test_max_temperature_loads_with_and_without_its_release_table() -> None:
    bare = parse_config(RESOURCES + "max_temperature_c = 83\n").resource[2]
    assert (bare.max_temperature_c, bare.heat) == (83.0, None)
    text = RESOURCES + "max_temperature_c = 80.5\n[resource.heat]\nrelease_after_s = 0\n"
    tuned = parse_config(text).resource[2]
    assert tuned.max_temperature_c == 80.5
    assert tuned.heat == schema.HeatConfig(release_margin_c=5.0, release_after_s=0.0)


@pytest.mark.parametrize("kind", ["memory", "cpu"])
def test_max_temperature_is_refused_on_other_kinds(kind: str) -> None:
    text = f'[[resource]]\nname = "r"\nkind = "{kind}"\nmax_temperature_c = 80\n'
    assert only_problem(text) == (
        "resource[0].max_temperature_c: only an nvidia_gpu reports a temperature"
    )


def test_a_heat_table_without_a_limit_is_refused() -> None:
    assert only_problem(RESOURCES + "[resource.heat]\nrelease_after_s = 30\n") == (
        "resource[2].heat: has no effect without max_temperature_c"
    )


def test_a_heat_table_on_a_non_gpu_is_refused() -> None:
    text = '[[resource]]\nname = "ram"\nkind = "memory"\n[resource.heat]\nrelease_after_s = 1\n'
    assert only_problem(text) == "resource[0].heat: the heat guard is for nvidia_gpu resources only"


def test_a_temperature_limit_is_a_number_not_a_string() -> None:
    assert only_problem(RESOURCES + 'max_temperature_c = "83"\n') == (
        "resource[2].max_temperature_c: expected a number, got '83'"
    )


def test_keep_free_on_a_cpu_is_refused() -> None:
    text = '[[resource]]\nname = "cpu"\nkind = "cpu"\nkeep_free_mib = 512\n'
    assert only_problem(text) == "resource[0].keep_free_mib: a cpu resource has no byte capacity"


# --- cross-field rules: tokens -----------------------------------------------------------


def test_token_with_both_sha256_and_file() -> None:
    text = token("t", '["read"]', f'sha256 = "{DIGEST}"\nfile = "/etc/vacancyd/t.token"')
    assert only_problem(text) == "auth.tokens[0]: give exactly one of sha256 or file"


def test_token_with_neither_sha256_nor_file() -> None:
    assert only_problem(token("t", '["read"]', "")) == (
        "auth.tokens[0]: give exactly one of sha256 or file"
    )


@pytest.mark.parametrize("digest", ["abc123", "AB" * 32, "g" * 64, DIGEST + "0"])
def test_sha256_must_be_64_lowercase_hex(digest: str) -> None:
    assert only_problem(token("t", '["read"]', f'sha256 = "{digest}"')) == (
        "auth.tokens[0].sha256: must be 64 lowercase hex digits (sha256 of the token)"
    )


def test_token_needs_a_scope() -> None:
    text = token("a", '["read"]') + token("b", "[]")
    assert only_problem(text) == "auth.tokens[1].scopes: at least one of borrow, read, admin"


def test_token_file_entry_loads_without_reading_the_file() -> None:
    config = parse_config(token("t", '["admin"]', 'file = "/nonexistent/vacancyd.token"'))
    assert config.auth.tokens[0].file == "/nonexistent/vacancyd.token"


# --- files that cannot be parsed or read ---------------------------------------------------


def test_toml_syntax_error_is_a_clean_config_error() -> None:
    with pytest.raises(ConfigError) as caught:
        parse_config('[server\napi_listen = "127.0.0.1:1"\n', source="bad.toml")
    [message] = caught.value.messages
    assert message.startswith("bad.toml: TOML syntax error: ")
    assert "line 1" in message


def test_missing_file_is_a_clean_config_error(tmp_path: Path) -> None:
    path = tmp_path / "absent.toml"
    with pytest.raises(ConfigError) as caught:
        load_config(path)
    assert caught.value.messages == [f"{path}: cannot read: No such file or directory"]


def test_directory_is_a_clean_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as caught:
        load_config(tmp_path)
    assert caught.value.messages == [f"{tmp_path}: cannot read: Is a directory"]


def test_non_utf8_file_is_a_clean_config_error(tmp_path: Path) -> None:
    path = tmp_path / "latin1.toml"
    path.write_bytes(b'[server]\nstate_dir = "/var/lib/caf\xe9"\n')
    with pytest.raises(ConfigError) as caught:
        load_config(path)
    [message] = caught.value.messages
    assert message.startswith(f"{path}: not UTF-8 text: ")


def test_syntax_error_in_a_file_names_the_file(tmp_path: Path) -> None:
    path = tmp_path / "broken.toml"
    path.write_text("[server]\napi_listen = \n", "utf-8")
    with pytest.raises(ConfigError) as caught:
        load_config(path)
    assert caught.value.messages[0].startswith(f"{path}: TOML syntax error: ")


# --- vacancyd check-config ---------------------------------------------------------------


def test_check_config_prints_every_problem_and_exits_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "vacancyd.toml"
    path.write_text(
        textwrap.dedent(
            """\
            [server]
            api_listn = "127.0.0.1:9460"

            [server.limits]
            max_request_body_mib = "64"

            [[resource]]
            kind = "memory"
            """
        ),
        "utf-8",
    )
    assert main(["check-config", str(path)]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    lines = err.splitlines()
    assert lines[0] == f"{path}: 3 problem(s):"
    assert sorted(lines[1:]) == [
        "  resource[0].name: required key is missing",
        "  server.limits.max_request_body_mib: expected an integer, got '64'",
        "  server: unknown key(s): api_listn",
    ]


def test_check_config_reports_cross_field_problems_too(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "open.toml"
    path.write_text(RESOURCES + upstream(listen="0.0.0.0:8081"), "utf-8")
    assert main(["check-config", str(path)]) == 2
    err = capsys.readouterr().err
    assert "upstream[0].listen: listens beyond loopback but no token has the borrow scope" in err


def test_check_config_exits_0_on_a_good_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "minimal.toml"
    path.write_text(DESIGN_MINIMAL, "utf-8")
    assert main(["check-config", str(path)]) == 0
    out, err = capsys.readouterr()
    assert out == f"{path}: ok (2 resource(s), 1 upstream(s))\n"
    assert err == ""


def test_check_config_accepts_the_example(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["check-config", str(EXAMPLE)]) == 0
    assert capsys.readouterr().out == f"{EXAMPLE}: ok (3 resource(s), 2 upstream(s))\n"


def test_check_config_on_a_missing_file_exits_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "nope.toml"
    assert main(["check-config", str(path)]) == 2
    err = capsys.readouterr().err
    assert err == (f"{path}: 1 problem(s):\n  {path}: cannot read: No such file or directory\n")


def nested(levels: int) -> str:
    return "[" * levels + "]" * levels


@pytest.mark.parametrize(
    "text",
    [
        f"x = {nested(5000)}\n",
        f"[server]\nstate_dir = {nested(5000)}\n",
        f"[owner]\nowner_processes = {nested(5000)}\n",
        f"x = {{ a = {nested(5000)} }}\n",
    ],
    ids=["top-level", "in-a-string-key", "in-a-list-key", "in-an-inline-table"],
)
@pytest.mark.parametrize("command", ["check-config", "run"])
def test_deep_nesting_is_one_problem_line_and_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], text: str, command: str
) -> None:
    path = tmp_path / "deep.toml"
    path.write_text(text, "utf-8")
    args = (
        ["check-config", str(path)] if command == "check-config" else ["run", "--config", str(path)]
    )
    assert main(args) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert err.splitlines() == [
        f"{path}: 1 problem(s):",
        f"  {path}: nested too deeply to read (over the parser's recursion limit)",
    ]


def test_nesting_the_parser_can_read_is_a_short_problem_on_its_key(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "deep.toml"
    path.write_text(f"[owner]\nowner_processes = {nested(150)}\n", "utf-8")
    assert main(["check-config", str(path)]) == 2
    lines = capsys.readouterr().err.splitlines()
    assert lines[0] == f"{path}: 1 problem(s):"
    assert lines[1].startswith("  owner.owner_processes[0]: expected a string, got [[[")
    assert len(lines) == 2 and len(lines[1]) < 200


# --- shapes and spellings that used to slip through ------------------------------------


def test_a_string_is_not_a_list_of_names() -> None:
    message = only_problem('[owner]\nowner_processes = "steam"\n')
    assert message.startswith("owner.owner_processes: ")


def test_a_scalar_where_a_table_belongs_says_so() -> None:
    message = only_problem(RESOURCES + upstream() + '[upstream.models]\n"m" = "big"\n')
    assert message.startswith("upstream[0].models")
    assert "unknown error" not in message
    assert "has no attribute" not in message


def test_footprint_type_error_uses_the_same_path_notation_as_range_errors() -> None:
    message = only_problem(RESOURCES + upstream(default_need_mib="{ gpu0 = 10.5 }"))
    assert message == 'upstream[0].default_need_mib."gpu0": expected an integer, got 10.5'


def test_the_state_dir_defaults_to_the_units_state_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Under systemd (StateDirectory=vacancyd) the service user may have no home: the
    directory systemd made for the unit is the default, the first of several."""
    from vacancyd.config.load import resolve_state_dir

    monkeypatch.setenv("STATE_DIRECTORY", f"{tmp_path}/a:{tmp_path}/b")
    assert resolve_state_dir(parse_config("")) == tmp_path / "a"
    # What the config says still wins.
    configured = parse_config(f'[server]\nstate_dir = "{tmp_path}/c"\n')
    assert resolve_state_dir(configured) == tmp_path / "c"
    # A relative value is not systemd's: ignored.
    monkeypatch.setenv("STATE_DIRECTORY", "relative")
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "xdg"))
    assert resolve_state_dir(parse_config("")) != Path("relative")


def test_each_upstream_carries_its_target_parsed_once_and_its_resources() -> None:
    """Every reader (proxy, tunnel, reclaim, spills, hand-off, collectors, footprints) takes
    `endpoint` and `resources` from the loaded upstream; nothing parses the URL again."""
    (upstream,) = config_from(BASIC).upstream
    assert upstream.endpoint == Target("http", "127.0.0.1", 9, "")
    assert upstream.endpoint is upstream.endpoint
    assert upstream.resources == ("ram", "cpu")


def test_a_bad_target_is_a_config_problem_at_its_key_not_a_crash_later() -> None:
    text = BASIC.replace('target = "http://127.0.0.1:9"', 'target = "ftp://127.0.0.1:9"')
    with pytest.raises(ConfigError) as caught:
        parse_config(text)
    assert "upstream[0].target: target must be an http:// or https:// URL" in str(caught.value)
