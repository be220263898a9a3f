"""What an end user sees when every lender of a group refuses and the gateway has nowhere
else to send the request, measured.

Run by hand, never by the tests (see tools/bench/README.md), from the repository root with
the test environment (it needs `litellm[proxy]` and `openai` from the test extra):

    python tools/bench/end_user_wait.py [--json FILE]

What runs, all on loopback: the real llama-server fixture, two vacancyd lenders in front of
it (both paused, as when both owners are at their desks), and LiteLLM's own proxy server
with one group `chat` of the two lenders and no fallback, once with vacancyd's callback
and once without it (a new user's config). The end user is the openai SDK as it comes
(2 retries) and with `max_retries=0`. For each, the time until the SDK raised, the status
it raised with, and the headers it was given: LiteLLM renames a backend's headers to
`llm_provider-*` and answers "no deployments" itself with a `retry-after` of its own,
which the SDK sleeps before each retry.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import openai
import trio

from tests.support.fleet_harness import HELLO, start_fleet
from tests.support.litellm_proxy import deployment, litellm_proxy
from tests.support.llama import llama_server
from tools.bench.common import version

CALLBACK = "vacancyd.integrations.litellm.vacancy_filter"
SHOWN_HEADERS = ("retry-after", "x-vacancyd-reason", "llm_provider-x-vacancyd-reason",
                 "llm_provider-retry-after", "x-litellm-attempted-retries")  # fmt: skip


def ask(gateway: str, key: str, retries: int) -> dict[str, Any]:
    """One end user's request with the SDK's own retry policy, in this thread."""
    client = openai.OpenAI(
        base_url=f"{gateway}/v1",
        api_key=key,
        max_retries=retries,
        timeout=120,
        http_client=openai.DefaultHttpxClient(trust_env=False),
    )
    started = time.monotonic()
    outcome: dict[str, Any] = {"retries": retries}
    try:
        client.chat.completions.create(model="chat", messages=HELLO, max_tokens=4)
        outcome["status"] = 200
    except openai.APIStatusError as exc:
        outcome["status"] = exc.status_code
        outcome["type"] = exc.type
        outcome["message"] = str(exc)[:160]
        headers = exc.response.headers
        outcome["headers"] = {name: headers[name] for name in SHOWN_HEADERS if name in headers}
    except openai.APIError as exc:
        outcome["status"] = 0
        outcome["message"] = f"{type(exc).__name__}: {exc}"[:160]
    finally:
        client.close()
    outcome["seconds"] = round(time.monotonic() - started, 2)
    return outcome


async def measure(directory: Path, llama_url: str) -> list[dict[str, Any]]:
    rows = []
    async with start_fleet(directory / "fleet", llama_url, 2) as fleet:
        for index in range(2):
            await fleet.pause(index)
        group = [deployment("chat", lender.url, probe=lender.probe) for lender in fleet.lenders]
        for callbacks in ([CALLBACK], []):
            where = directory / ("callback" if callbacks else "plain")
            async with litellm_proxy(where, group, callbacks=callbacks) as gateway:
                for retries in (2, 0):
                    row = await trio.to_thread.run_sync(
                        ask, gateway.url, gateway.master_key, retries
                    )
                    row["gateway"] = "callback" if callbacks else "no callback"
                    rows.append(row)
                    print(json.dumps(row), flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    print(f"vacancyd {version()}, litellm {_litellm_version()}")
    with tempfile.TemporaryDirectory() as directory, llama_server() as llama_url:
        rows = trio.run(measure, Path(directory), llama_url)
    print(f"\n{'gateway':12} {'SDK retries':>11} {'status':>6} {'seconds':>8}  headers")
    for row in rows:
        print(
            f"{row['gateway']:12} {row['retries']:>11} {row['status']:>6} {row['seconds']:>8}"
            f"  {row.get('headers', {})}"
        )
    print("\ncommand: python tools/bench/end_user_wait.py")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))


def _litellm_version() -> str:
    from importlib import metadata

    return metadata.version("litellm")


if __name__ == "__main__":
    main()
