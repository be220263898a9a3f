"""ComfyUI's memory of its own: what its allocator holds is reused by the next prompt.

`/system_stats` reports `torch_vram_total`, the GPU memory PyTorch's allocator in the
ComfyUI process has reserved: loaded models and cached blocks it frees or reuses for the
next prompt by itself. None of it is the owner's, so on a route with exactly one GPU it
is added back to that GPU's free memory when a borrowed prompt is judged (the seed's
rule). It proves nothing about parallelism: ComfyUI runs one prompt at a time, so the
ledger still lends it one job per resource.
"""

from __future__ import annotations

from vacancyd.adapters.actions import UpstreamCallError, UpstreamContext, call
from vacancyd.adapters.residency import WorkRequest
from vacancyd.model import MIB, Residency


class ComfyUIResidency:
    source = "/system_stats"

    async def read(self, context: UpstreamContext) -> int:
        """torch_vram_total of the one device ComfyUI reports, in bytes."""
        stats = (await call(context, "GET", "/system_stats")).expect_ok().json()
        devices = stats.get("devices") if isinstance(stats, dict) else None
        if not isinstance(devices, list) or len(devices) != 1 or not isinstance(devices[0], dict):
            raise UpstreamCallError("GET /system_stats did not list exactly one device")
        held = devices[0].get("torch_vram_total")
        if not isinstance(held, int) or isinstance(held, bool) or held < 0:
            raise UpstreamCallError("GET /system_stats gave no torch_vram_total")
        return held

    def judge(self, reading: int, request: WorkRequest, taken_at: float) -> Residency:
        reusable = reading // MIB
        return Residency(
            False,
            taken_at,
            self.source,
            f"ComfyUI's allocator holds {reusable} MiB it reuses for the next prompt",
            reusable_mib=reusable,
        )

    async def learn(self, context: UpstreamContext, request: WorkRequest) -> None:
        return None
