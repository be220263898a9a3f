"""`vacancyd footprint` and admission charge the same MiB for the same model and server.

Each case runs the real CLI (`vacancyd.cli.main`, `--json`) and asks a running daemon's
vacancy probe what a request for the model is charged, against the same server: the real
llama-server (behind an API key in one case, so the estimate's reads must carry the
upstream's credential) and the fake Ollama in a process of its own, whose environment
sets the KV cache type, flash attention and slots, as a real Ollama's does. Each layout
is tried with the model on host memory and on a GPU (the runtime base differs).

Also here: an estimate follows the server's model when its file or digest changes, and a
load's host-memory footprint is learned from the server's process tree.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio
import trio.testing

from tests.support.clients import lender_config
from tests.support.daemon import InProcessDaemon, in_process_daemon
from tests.support.echo_process import echo_process
from tests.support.fake_http import serve_fake
from tests.support.fake_ollama import FakeOllama, llama31_8b
from tests.support.gguf_files import write_llama3_8b
from tests.support.llama import llama_paths, llama_server
from vacancyd.cli import main
from vacancyd.config import parse_config
from vacancyd.footprint.book import RECHECK_AFTER_S, FootprintBook
from vacancyd.footprint.learned import LearnedFootprints
from vacancyd.persist import StateFileProblems

TOKEN = "upstream-secret-for-tests"
# What the fake Ollama's server environment says, as `ollama serve` would read it.
OLLAMA_ENV = {
    "OLLAMA_KV_CACHE_TYPE": "q8_0",
    "OLLAMA_FLASH_ATTENTION": "1",
    "OLLAMA_NUM_PARALLEL": "2",
}
GPU_LAYOUT = """resource = "gpu0"
also_requires = ["ram"]
default_need_mib = { gpu0 = 100, ram = 700 }
"""


def config_for(target: str, state: Path, adapter: str, on_gpu: bool, extra: str = "") -> str:
    """One upstream named lender, its model on host memory (ram) or on gpu0 (then ram is
    charged its default, a floor nothing was found for)."""
    text = lender_config(target, state, adapter=adapter, upstream_extra=extra)
    if not on_gpu:
        return text
    gpu = '[[resource]]\nname = "gpu0"\nkind = "nvidia_gpu"\ndevice = 0\n[[upstream]]'
    text = text.replace("[[upstream]]", gpu, 1)
    return text.replace('resource = "ram"\n', GPU_LAYOUT, 1)


async def cli_json(
    capsys: pytest.CaptureFixture[str], config: str, tmp_path: Path, *extra: str
) -> dict[str, Any]:
    """`vacancyd footprint --config ... --json` (on a thread: it blocks on the server)."""
    path = tmp_path / "vacancyd.toml"
    path.write_text(config)
    arguments = ["footprint", "--config", str(path), "--json", *extra]
    status = await trio.to_thread.run_sync(main, arguments)
    captured = capsys.readouterr()
    assert status == 0, captured.err
    document: dict[str, Any] = json.loads(captured.out)
    return document


async def probe(daemon: InProcessDaemon, model: str) -> dict[str, Any]:
    async with httpx.AsyncClient(trust_env=False, timeout=30) as http:
        answer = await http.get(f"{daemon.api}/vacancy/lender", params={"model": model})
    body: dict[str, Any] = answer.json()
    return body


def assert_agree(cli: dict[str, Any], charged: dict[str, Any]) -> None:
    assert charged["need_mib"] == cli["charged_mib"], (charged, cli)
    assert charged["need_sources"] == cli["charged_sources"]
    # Nothing resident to credit on a load's first request: the charge is the need.
    if charged["resident"] is not True:
        assert charged["charged_mib"] == cli["charged_mib"]


def private_file(path: Path, text: str) -> str:
    path.write_text(text)
    path.chmod(0o600)
    return str(path)


@pytest.mark.slow
@pytest.mark.parametrize("on_gpu", [False, True], ids=["host", "gpu"])
async def test_llama_server_cli_and_admission_agree(
    on_gpu: bool, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A llama-server behind an API key: /props answers only with the credential, so both
    sides must send it to estimate at all; its q8_0 cache (its -ctk/-ctv: /props does
    not say) is what both size."""
    credential = private_file(tmp_path / "credential", TOKEN)
    extra = ["--api-key", TOKEN, "-ctk", "q8_0", "-ctv", "q8_0"]
    with llama_server(extra=extra) as url:
        upstream_extra = f'credential_file = "{credential}"'
        config = config_for(url, tmp_path / "state", "llamacpp", on_gpu, upstream_extra)
        cli = await cli_json(capsys, config, tmp_path)
        async with in_process_daemon(config) as daemon:
            charged = await probe(daemon, cli["model"])
    sized = "gpu0" if on_gpu else "ram"
    assert cli["charged_sources"][sized] == "estimated", cli
    assert cli["cache_type"] == "q8_0", cli["cache_type_source"]
    assert_agree(cli, charged)
    runtime = 512 if on_gpu else 1024
    weights = cli["estimate"]["weights_mib"]
    assert cli["estimate"]["overhead_mib"] == runtime + -(-weights // 10)
    if on_gpu:
        assert cli["charged_mib"]["ram"] == 700 and cli["charged_sources"]["ram"] == "default"


@pytest.mark.slow
async def test_a_llama_server_started_without_cache_flags_runs_f16(
    llama_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = config_for(llama_url, tmp_path / "state", "llamacpp", False)
    cli = await cli_json(capsys, config, tmp_path)
    assert cli["cache_type"] == "f16", cli
    assert cli["cache_type_source"] == "llama-server's -ctk/-ctv (f16 unset): K f16, V f16"


def test_a_server_that_cannot_be_read_is_stated_as_f16_assumed(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """No process to read (a target elsewhere, here a file given instead): f16, said so."""
    path = write_llama3_8b(tmp_path / "m.gguf")
    assert main(["footprint", "--gguf", str(path), "--json"]) == 0
    document = json.loads(capsys.readouterr().out)
    assert document["cache_type"] == "f16"
    assert document["cache_type_source"].startswith("f16 assumed")


@asynccontextmanager
async def ollama_process(rss_mib: int = 0) -> AsyncIterator[str]:
    async with echo_process(ollama_rss_mib=rss_mib, env=OLLAMA_ENV) as process:
        yield process.url


@pytest.mark.parametrize("on_gpu", [False, True], ids=["host", "gpu"])
async def test_ollama_cli_and_admission_agree(
    on_gpu: bool, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    async with ollama_process() as url:
        config = config_for(url, tmp_path / "state", "ollama", on_gpu)
        cli = await cli_json(capsys, config, tmp_path, "--model", "llama3.1:8b")
        async with in_process_daemon(config) as daemon:
            charged = await probe(daemon, "llama3.1:8b")
    # The server's own settings, read from its environment: q8_0 (flash attention on),
    # two slots of the Modelfile's 8192 tokens.
    assert cli["cache_type"] == "q8_0", cli["cache_type_source"]
    assert cli["estimate"]["context_tokens"] == 16384 and cli["estimate"]["parallel"] == 2
    assert cli["estimate"]["kv_cache_mib"] == 1088  # 2 GiB of f16 cells at 34/64 the size
    assert_agree(cli, charged)


async def test_an_ollama_model_that_changes_is_estimated_again(
    mock_clock: trio.testing.MockClock, tmp_path: Path
) -> None:
    """The same name, a new digest (a pull, a create): the estimate follows at the next
    check of the model's identity, and not before."""
    ollama = FakeOllama(models={"llama3.1:8b": llama31_8b()})
    async with serve_fake(ollama) as server:
        upstream = parse_config(config_for(server.url, tmp_path, "ollama", False)).upstream[0]
        book = FootprintBook(tmp_path, StateFileProblems())
        first = await book.hint(upstream, "llama3.1:8b")
        bigger = llama31_8b(size=2 * 4_920_753_328, revision="2")
        ollama.models["llama3.1:8b"] = bigger
        assert await book.hint(upstream, "llama3.1:8b") == first
        mock_clock.jump(RECHECK_AFTER_S)
        second = await book.hint(upstream, "llama3.1:8b")
    assert first is not None and second is not None
    assert second.need_mib["ram"] - first.need_mib["ram"] > 4000, (first, second)


@pytest.mark.slow
async def test_a_llama_servers_model_file_that_changes_is_estimated_again(
    mock_clock: trio.testing.MockClock, tmp_path: Path
) -> None:
    """llama-server keeps the file it mapped; the path it names now holds another model
    (Llama 3 8B's header in place of Gemma 3 270M): the next check sees a new file."""
    served = tmp_path / "model.gguf"
    shutil.copyfile(llama_paths()[1], served)
    with llama_server(extra=["-m", str(served)]) as url:
        upstream = parse_config(config_for(url, tmp_path, "llamacpp", False)).upstream[0]
        book = FootprintBook(tmp_path, StateFileProblems())
        first = await book.hint(upstream, None)
        replacement = write_llama3_8b(tmp_path / "next.gguf")
        os.replace(replacement, served)
        assert await book.hint(upstream, None) == first
        mock_clock.jump(RECHECK_AFTER_S)
        second = await book.hint(upstream, None)
    assert first is not None and second is not None
    assert first.need_mib["ram"] < 2000, first
    assert second.need_mib["ram"] > 6000, second


@pytest.mark.slow
async def test_a_loads_host_memory_is_learned_from_the_servers_processes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The fake Ollama's load holds 320 MiB in its own process: the exclusive job that
    loaded it is measured by the growth of the server's RSS, learned for ram, charged
    from then on, and shown by the CLI the same way."""
    state = tmp_path / "state"
    async with ollama_process(rss_mib=320) as url:
        config = config_for(url, state, "ollama", False)
        async with in_process_daemon(config) as daemon:
            assert (await probe(daemon, "llama3.1:8b"))["need_sources"] == {"ram": "estimated"}
            async with httpx.AsyncClient(trust_env=False, timeout=30) as http:
                answer = await http.post(
                    f"{daemon.proxy('lender')}/api/chat",
                    json={"model": "llama3.1:8b", "messages": [{"role": "user", "content": "hi"}]},
                )
            assert answer.status_code == 200, answer.text

            def learned() -> dict[str, int]:
                store = LearnedFootprints(state)
                store.load()
                return store.get("lender", "llama3.1:8b")

            with trio.fail_after(30):
                while not learned():
                    await daemon.state.wait_changed()
            charged = await probe(daemon, "llama3.1:8b")
        cli = await cli_json(capsys, config, tmp_path, "--model", "llama3.1:8b")
    assert 320 <= learned()["ram"] < 360, learned()
    assert charged["need_sources"] == {"ram": "learned"}
    assert charged["need_mib"] == learned()
    assert_agree(cli, charged)
