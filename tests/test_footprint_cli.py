"""`vacancyd footprint` end to end: a GGUF file, the real llama-server, a stand-in Ollama.

The snippet it prints is pasted into a valid config and checked by `vacancyd check-config`
(the real loader), so the CLI cannot drift from the config schema. The worked example in
the docs is recomputed here from a file with Llama 3 8B's real geometry and tensor table.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from tests.support.configs import daemon_config, memory, nvidia_gpu, upstream
from tests.support.fake_ollama import LLAMA31_8B_INFO
from tests.support.gguf_files import write_llama3_8b
from tests.support.llama import REPO, llama_paths
from vacancyd.cli import main
from vacancyd.config import load_config
from vacancyd.footprint.learned import LearnedFootprints

PARTS = ("weights", "KV cache", "recurrent state", "overhead", "margin", "total")


def config_text(state_dir: Path, adapter: str, target: str, extra: str = "") -> str:
    return daemon_config(
        upstream("llm", target, adapter=adapter, resource="gpu0", also_requires=["ram"]),
        state_dir=state_dir,
        poll_interval_s=None,
        resources=[memory(), nvidia_gpu()],
        tail=extra,
    )


def snippet_of(output: str) -> str:
    return output[output.index("# Paste") :]


def run_cli(*arguments: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "vacancyd", *arguments],
        capture_output=True,
        text=True,
        check=False,
        timeout=120,
        cwd=REPO,
    )


@pytest.mark.slow
def test_gguf_estimate_prints_its_parts_and_a_snippet_check_config_accepts(
    tmp_path: Path,
) -> None:
    _, model = llama_paths()
    result = run_cli("footprint", "--gguf", model, "--context", "2048", "--model", "gemma3:270m")
    assert result.returncode == 0, result.stderr
    for part in PARTS:
        assert part in result.stdout
    assert "KV cache              21 MiB" in result.stdout
    snippet = snippet_of(result.stdout)
    assert '[upstream.models."gemma3:270m"]' in snippet
    config = tmp_path / "vacancyd.toml"
    config.write_text(config_text(tmp_path, "llamacpp", "http://127.0.0.1:8080") + snippet + "\n")
    checked = run_cli("check-config", str(config))
    assert checked.returncode == 0, checked.stderr
    total = int(snippet.split("gpu0 = ")[1].split()[0])
    assert load_config(config).upstream[0].models["gemma3:270m"].need_mib == {"gpu0": total}


def test_real_llama_server_gives_model_file_context_and_slots(
    llama_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # The session's llama-server runs -c 2048 -np 2: /props says 1024 per slot, 2 slots.
    config = tmp_path / "vacancyd.toml"
    config.write_text(
        config_text(tmp_path, "llamacpp", llama_url, "default_need_mib = { ram = 512 }")
    )
    assert main(["footprint", "--config", str(config)]) == 0
    output = capsys.readouterr().out
    assert "model: gemma3-270m" in output
    assert f"GGUF header of {llama_paths()[1]} (llama-server /props model_path)" in output
    assert "context: 2048 tokens, 2 slot(s) · llama-server /props: 1024 per slot x 2" in output
    # What the server itself allocated for this: 6 MiB (global layers) + 30 MiB (sliding).
    assert "KV cache              36 MiB" in output
    assert "learned: none recorded" in output
    # The model's own table replaces default_need_mib, so the snippet keeps the ram need.
    snippet = snippet_of(output)
    assert "ram = 512" in snippet
    config.write_text(config.read_text() + snippet + "\n")
    assert main(["check-config", str(config)]) == 0


def test_learned_footprints_are_shown_and_win_when_larger(
    llama_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    learned = LearnedFootprints(tmp_path)
    learned.record("llm", "gemma3-270m", "gpu0", 5000)
    learned.record("llm", "gemma3-270m", "ram", 300)
    learned.save()
    config = tmp_path / "vacancyd.toml"
    config.write_text(config_text(tmp_path, "llamacpp", llama_url))
    assert main(["footprint", "--config", str(config), "--json"]) == 0
    document = json.loads(capsys.readouterr().out)
    assert document["learned_mib"] == {"gpu0": 5000, "ram": 300}
    assert document["need_mib"] == {"gpu0": 5000, "ram": 300}
    assert document["estimate"]["total_mib"] < 5000
    assert document["estimate"]["kv_cache_mib"] == 36


def test_an_untrusted_learned_file_is_named_not_used(
    llama_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "footprints.json").write_text("{}")
    (tmp_path / "footprints.json").chmod(0o644)
    config = tmp_path / "vacancyd.toml"
    config.write_text(config_text(tmp_path, "llamacpp", llama_url))
    assert main(["footprint", "--config", str(config)]) == 0
    assert "footprints.json cannot be used: is readable or writable by other users" in (
        capsys.readouterr().out
    )


class FakeOllama(ThreadingHTTPServer):
    """Answers /api/show and /api/tags as Ollama does for llama3.1:8b (Q4_K_M)."""

    requests: list[dict[str, Any]]


class _OllamaHandler(BaseHTTPRequestHandler):
    server: FakeOllama

    def do_GET(self) -> None:
        if self.path != "/api/tags":
            self._send(404, {"error": "not found"})
            return
        model = {"name": "llama3.1:8b", "model": "llama3.1:8b", "size": 4_920_753_328}
        self._send(200, {"models": [model]})

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.server.requests.append(body)
        if body.get("model") != "llama3.1:8b":
            self._send(404, {"error": f"model '{body.get('model')}' not found"})
            return
        # A per-layer array, elided to [] without verbose as Ollama does past 5 items.
        per_layer = [8] * 32 if body.get("verbose") else []
        info = {
            **LLAMA31_8B_INFO,
            "llama.attention.head_count_kv": per_layer,
            "tokenizer.ggml.tokens": [],
        }
        parameters = (
            'num_ctx                        8192\nstop                           "<|eot_id|>"'
        )
        self._send(200, {"model_info": info, "parameters": parameters, "details": {}})

    def _send(self, status: int, document: Any) -> None:
        raw = json.dumps(document).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(raw)))
        self.end_headers()
        self.wfile.write(raw)

    def log_message(self, *_: Any) -> None:
        pass


@pytest.fixture
def fake_ollama() -> Iterator[FakeOllama]:
    server = FakeOllama(("127.0.0.1", 0), _OllamaHandler)
    server.requests = []
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)


def test_ollama_model_info_size_and_num_ctx(
    fake_ollama: FakeOllama, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    host, port = fake_ollama.server_address[:2]
    config = tmp_path / "vacancyd.toml"
    config.write_text(config_text(tmp_path, "ollama", f"http://{host}:{port}"))
    assert main(["footprint", "--config", str(config), "--model", "llama3.1:8b"]) == 0
    output = capsys.readouterr().out
    assert "Ollama /api/show model_info for llama3.1:8b" in output
    assert "context: 8192 tokens, 1 slot(s) · Modelfile num_ctx 8192 x 1" in output
    assert "KV cache            1024 MiB" in output  # 8 KV heads per layer, from verbose
    assert "weights             4693 MiB" in output  # /api/tags size
    # The per-layer array came back elided, so the model was asked again with verbose.
    assert [r.get("verbose", False) for r in fake_ollama.requests] == [False, True]
    config.write_text(config.read_text() + snippet_of(output) + "\n")
    assert main(["check-config", str(config)]) == 0


def test_ollama_needs_a_model_and_reports_an_unknown_one(
    fake_ollama: FakeOllama, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    host, port = fake_ollama.server_address[:2]
    config = tmp_path / "vacancyd.toml"
    config.write_text(config_text(tmp_path, "ollama", f"http://{host}:{port}"))
    assert main(["footprint", "--config", str(config)]) == 1
    assert "needs --model" in capsys.readouterr().err
    assert main(["footprint", "--config", str(config), "--model", "nope"]) == 1
    assert "answered 404" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("arguments", "message", "status"),
    [
        (["--upstream", "llm"], "--upstream needs --config", 1),
        ([], "give --gguf PATH", 1),
        (["--gguf", "/nonexistent/model.gguf"], "No such file", 1),
        (["--config", "{config}", "--upstream", "other"], "no upstream named 'other'", 1),
        (["--config", "{config}", "--resource", "cpu9"], "not one of upstream", 1),
        (["--config", "{bad}"], "problem(s)", 2),
        (["--config", "{config}"], "cannot tell a model's geometry; give --gguf", 1),
    ],
)
def test_mistakes_are_explained(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    arguments: list[str],
    message: str,
    status: int,
) -> None:
    config = tmp_path / "ok.toml"
    config.write_text(config_text(tmp_path, "openai", "http://127.0.0.1:9"))
    bad = tmp_path / "bad.toml"
    bad.write_text("[server]\nno_such_key = 1\n")
    filled = [a.format(config=config, bad=bad) for a in arguments]
    assert main(["footprint", *filled]) == status
    assert message in capsys.readouterr().err


def test_zero_slots_or_context_are_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = write_llama3_8b(tmp_path / "m.gguf")
    for option in ("--parallel", "--context"):
        assert main(["footprint", "--gguf", str(path), option, "0"]) == 1
        assert "must be at least 1" in capsys.readouterr().err


def test_a_host_memory_resource_gets_the_host_runtime_base(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = write_llama3_8b(tmp_path / "m.gguf")
    config = tmp_path / "vacancyd.toml"
    config.write_text(config_text(tmp_path, "openai", "http://127.0.0.1:9"))
    arguments = ["footprint", "--config", str(config), "--gguf", str(path), "--resource", "ram"]
    assert main(arguments) == 0
    output = capsys.readouterr().out
    assert "1024 MiB runtime" in output
    assert "ram = " in snippet_of(output)


def test_an_unreachable_llama_server_is_reported(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = tmp_path / "vacancyd.toml"
    config.write_text(config_text(tmp_path, "llamacpp", "http://127.0.0.1:9"))
    assert main(["footprint", "--config", str(config)]) == 1
    assert "cannot reach http://127.0.0.1:9/props" in capsys.readouterr().err
    # With a file given, the estimate goes on at the default context, and says so.
    _, model = llama_paths()
    assert main(["footprint", "--config", str(config), "--gguf", model]) == 0
    assert "the server did not answer" in capsys.readouterr().out


def test_the_worked_example_in_the_docs_is_what_the_cli_prints(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = write_llama3_8b(tmp_path / "Meta-Llama-3-8B-Instruct-Q4_K_M.gguf")
    arguments = ["footprint", "--gguf", str(path), "--context", "8192", "--model", "llama3:8b"]
    assert main(arguments) == 0
    output = capsys.readouterr().out
    configuration = (REPO / "docs" / "configuration.md").read_text()
    admission = (REPO / "docs" / "admission-and-recovery.md").read_text()
    part_lines = [line for line in output.splitlines() if line.lstrip().startswith(PARTS)]
    assert len(part_lines) == len(PARTS)
    for line in part_lines:
        assert line in configuration, line
    for line in snippet_of(output).splitlines()[1:]:
        assert line in configuration, line
    total = part_lines[-1].split()[1]
    assert f"{total} MiB" in admission
