"""The fake Ollama on a stand-in GPU: its models' memory shows in NVML, and it stops work
whose client went away, as Ollama does.

Two things the reclaim tests (and tools/bench/reclaim_latency.py) need that the plain fake
leaves out:

* `GpuMirror` keeps the stand-in libnvidia-ml's state file in step with the fake's
  residency: the GPU's used memory is a fixed base plus the `size_vram` of every resident
  model. It is rewritten from the fake's unload hook, so memory comes back only when the
  fake really lets a model go (after its unload delay and after its last request ended),
  never when the unload is merely acknowledged.
* `DisconnectingOllama` ends a request's handler as soon as its client disconnects, the
  way Ollama cancels a generation whose HTTP request context is done, and records when
  that happened (`disconnects`, on `time.perf_counter()`). Without it a stream held by
  `hold_streams()` would keep its model in use forever after the proxy cut it.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import attrs
import trio

from tests.support.fake_nvml import FakeGpu, FakeNvml, NvmlState, fake_nvml_library
from tests.support.fake_ollama import FakeOllama

GPU_UUID = "GPU-5b1f0c2e-7a3d-4e8f-9c6b-2d1e0f3a4b5c"


@attrs.define(eq=False)
class DisconnectingOllama(FakeOllama):
    """FakeOllama whose HTTP handlers are cancelled when their client leaves mid-answer."""

    # perf_counter() of each client departure that cut a request short, in order.
    disconnects: list[float] = attrs.Factory(list)

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await super().__call__(scope, receive, send)
            return
        body_read = trio.Event()

        async def receive_body() -> Any:
            message = await receive()
            if message["type"] != "http.request" or not message.get("more_body"):
                body_read.set()
            return message

        async with trio.open_nursery() as nursery:

            async def cancel_when_gone() -> None:
                await body_read.wait()
                while (await receive())["type"] != "http.disconnect":
                    pass
                self.disconnects.append(time.perf_counter())
                self.changes.note()
                nursery.cancel_scope.cancel()

            nursery.start_soon(cancel_when_gone)
            await super().__call__(scope, receive_body, send)
            nursery.cancel_scope.cancel()


@attrs.define
class GpuMirror:
    """One stand-in GPU whose used memory is `base_used` plus the fake's resident models."""

    state: NvmlState
    ollama: FakeOllama
    total_bytes: int
    base_used: int
    world: FakeNvml = attrs.field(init=False)

    def __attrs_post_init__(self) -> None:
        self.world = FakeNvml(
            gpus=[FakeGpu(uuid=GPU_UUID, total_bytes=self.total_bytes, used_bytes=self.base_used)]
        )

    @property
    def resident_vram(self) -> int:
        return sum(resident.size_vram for resident in self.ollama.resident.values())

    @property
    def free_bytes(self) -> int:
        return self.world.gpus[0].free_bytes

    def write(self) -> None:
        """Write the state file from the fake's residency as it is now."""
        self.world.gpus[0].used_bytes = self.base_used + self.resident_vram
        self.state.write(self.world)

    def follow_unloads(self) -> None:
        """Rewrite the state each time the fake lets a model go."""
        self.ollama.on_unload.append(lambda _name: self.write())


async def load_models(ollama: FakeOllama, client: Any, *names: str) -> None:
    """Load models straight on the fake (not through vacancyd), kept resident for good."""
    for name in names:
        reply = await client.post(
            f"{ollama.url}/api/generate", json={"model": name, "prompt": "", "keep_alive": -1}
        )
        assert reply.status_code == 200, reply.text
    assert set(names) <= set(ollama.resident)


def fake_nvml_env(state: Path, log: Path) -> dict[str, str]:
    """What a daemon subprocess needs to load the stand-in as its libnvidia-ml.so.1."""
    library_dir = str(fake_nvml_library().parent)
    inherited = os.environ.get("LD_LIBRARY_PATH")
    return {
        "LD_LIBRARY_PATH": f"{library_dir}:{inherited}" if inherited else library_dir,
        "FAKE_NVML_STATE": str(state),
        "FAKE_NVML_LOG": str(log),
    }
