"""The fleet's Prometheus rules and Grafana dashboard (conf/) name only series vacancyd
really publishes: every `vacancyd_*` name in them is read off a running daemon's /metrics,
and every recorded `vacancyd:*` series a panel uses is one the rules file records. A
renamed metric fails here, not on an operator's dashboard months later."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio

from tests.support.configs import daemon_config, memory, nvidia_gpu, upstream
from tests.support.daemon import in_process_daemon
from tests.support.fake_nvml import (
    FakeGpu,
    FakeNvml,
    FakeNvmlFixture,
    fake_nvml_fixture,  # noqa: F401  (registers the fake_nvml fixture)
    fake_nvml_session_fixture,  # noqa: F401  (registers the fake_nvml_session fixture)
    install,
)
from tests.support.upstreams import EchoUpstream

# While modules are being collected: before any thread exists, and before anything in this
# process could make pynvml open a real driver (see tests/support/fake_nvml.py).
install()

yaml = pytest.importorskip("yaml")

CONF = Path(__file__).resolve().parents[1] / "conf"
SERIES = re.compile(r"\b(vacancyd(?:_[a-z]+)+)\b")
RECORDED = re.compile(r"\b(vacancyd:[a-z_:0-9]+)\b")


def config(target: str, state_dir: Path) -> str:
    """A lender with a GPU (the fake NVML's) and host memory, so that both kinds of
    resource publish their series."""
    return daemon_config(
        upstream(
            "lender", target, adapter="llamacpp", resource="gpu0", default_need_mib={"gpu0": 512}
        ),
        state_dir=state_dir,
        poll_interval_s=None,
        resources=[nvidia_gpu(pressure={"enabled": False}), memory()],
    )


def rules() -> list[dict[str, Any]]:
    document = yaml.safe_load((CONF / "prometheus" / "vacancyd-fleet.rules.yml").read_text())
    return [rule for group in document["groups"] for rule in group["rules"]]


def panel_exprs() -> list[str]:
    dashboard = json.loads((CONF / "grafana" / "vacancyd-fleet.json").read_text())
    return [target["expr"] for panel in dashboard["panels"] for target in panel["targets"]]


async def published(daemon_api: str) -> set[str]:
    """Every series name on /metrics, counters with their `_total`."""
    async with httpx.AsyncClient(trust_env=False, timeout=10) as client:
        text = (await client.get(f"{daemon_api}/metrics")).text
    return {
        line.split("{")[0].split(" ")[0]
        for line in text.splitlines()
        if line and not line.startswith("#")
    }


async def test_rules_and_dashboard_name_only_published_series(
    echo: EchoUpstream, fake_nvml: FakeNvmlFixture, tmp_path: Path
) -> None:
    fake_nvml.state.write(FakeNvml(gpus=[FakeGpu(uuid="GPU-fleet", util_pct=7)]))
    async with in_process_daemon(config(echo.url, tmp_path / "state")) as daemon:
        async with httpx.AsyncClient(trust_env=False, timeout=10) as client:
            # One refusal and one admission, so that their counters carry a series.
            await client.post(
                f"{daemon.proxy('lender')}/v1/chat/completions",
                json={"model": "m", "messages": [{"role": "user", "content": "hi"}]},
            )
            daemon.state.set_lending(False)
            await client.post(
                f"{daemon.proxy('lender')}/v1/chat/completions",
                json={"model": "m", "messages": [{"role": "user", "content": "hi"}]},
            )
        with trio.fail_after(10):
            names = await published(daemon.api)
    recorded = {rule["record"] for rule in rules() if "record" in rule}
    expressions = [rule["expr"] for rule in rules()] + panel_exprs()
    used = {name for expr in expressions for name in SERIES.findall(expr)}
    assert used, "no series found: the pattern is wrong"
    assert used <= names, sorted(used - names)
    asked = {name for expr in panel_exprs() for name in RECORDED.findall(expr)}
    assert asked <= recorded, sorted(asked - recorded)
    alerts = {rule["alert"] for rule in rules() if "alert" in rule}
    wanted = {"VacancydLenderDown", "VacancydUpstreamUnreachable", "VacancydRefusingForHours"}
    assert wanted <= alerts


def test_the_scrape_config_loads_the_rules_beside_it() -> None:
    config = yaml.safe_load((CONF / "prometheus" / "prometheus-fleet.yml").read_text())
    assert config["rule_files"] == ["vacancyd-fleet.rules.yml"]
    (job,) = config["scrape_configs"]
    assert job["job_name"] == "vacancyd" and job["metrics_path"] == "/metrics"
