"""One stand-in GPU that the fake Ollama and the fake ComfyUI both load models onto.

The GPU's used memory is a fixed base (the owner's, or a server that holds its model for
good, such as llama-server) plus every model resident in the fake Ollama (`size_vram`)
plus every checkpoint the fake ComfyUI holds. `follow` rewrites the stand-in NVML's state
file whenever either fake changes, so vacancyd reads a load when the server really loads
and memory back only when the server really lets a model go: the fake Ollama does that
only after its unload delay, after acknowledging the unload, which is seed 002's lesson
(an unload answers before the driver has freed the memory).
"""

from __future__ import annotations

import math
from pathlib import Path

import attrs
import trio

from tests.support.configs import cpu, daemon_config, memory, nvidia_gpu, upstream
from tests.support.fake_comfyui import FakeComfyUI
from tests.support.fake_http import Changes
from tests.support.fake_nvml import FakeGpu, FakeNvml, NvmlState
from tests.support.fake_ollama import FakeOllama
from tests.support.ollama_gpu import GPU_UUID


@attrs.define
class SharedGpu:
    state: NvmlState
    total_bytes: int
    base_used: int
    ollama: FakeOllama
    comfyui: FakeComfyUI
    world: FakeNvml = attrs.field(init=False)
    written_used: int = -1

    def __attrs_post_init__(self) -> None:
        self.world = FakeNvml(
            gpus=[FakeGpu(uuid=GPU_UUID, total_bytes=self.total_bytes, used_bytes=self.base_used)]
        )

    @property
    def used_bytes(self) -> int:
        ollama = sum(resident.size_vram for resident in self.ollama.resident.values())
        return self.base_used + ollama + sum(self.comfyui.loaded.values())

    @property
    def free_bytes(self) -> int:
        return self.total_bytes - self.used_bytes

    def write(self) -> None:
        used = self.used_bytes
        self.world.gpus[0].used_bytes = used
        self.state.write(self.world)
        self.written_used = used

    async def follow(self, nursery: trio.Nursery) -> None:
        """Write now, then after every change of either fake that moves the used memory."""
        self.write()
        for changes in (self.ollama.changes, self.comfyui.changes):
            nursery.start_soon(self._follow, changes)

    async def _follow(self, changes: Changes) -> None:
        while True:
            await changes.wait_until(
                lambda: self.used_bytes != self.written_used, timeout_s=math.inf
            )
            self.write()


def two_servers_config(
    state_dir: Path,
    first_url: str,
    comfy_url: str,
    *,
    idle_s: float,
    timeout_s: float = 5.0,
    first: str = "ollama",
    first_need_mib: int = 10240,
    spilled_models: str = "charge",
    poll_interval_s: float = 0.2,
    first_priority: int = 0,
) -> str:
    """vacancyd in front of two servers on the one GPU: the one that may give way (`first`,
    named after its adapter) and ComfyUI, each charged 10 GiB of it by default; the host's
    memory and CPU, for requests to a model spilled to the CPU; headless, pressure off."""
    return daemon_config(
        upstream(
            first,
            first_url,
            adapter=first,
            resource="gpu0",
            default_need_mib={"gpu0": first_need_mib},
            handoff_idle_s=idle_s,
            handoff_priority=first_priority,
            spilled_models=spilled_models,
        ),
        upstream(
            "comfy",
            comfy_url,
            adapter="comfyui",
            resource="gpu0",
            default_need_mib={"gpu0": 10240},
            handoff_timeout_s=timeout_s,
        ),
        state_dir=state_dir,
        poll_interval_s=poll_interval_s,
        resources=[nvidia_gpu(pressure={"enabled": False}), memory(), cpu()],
    )
