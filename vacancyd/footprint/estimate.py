"""How much memory serving a model takes, estimated from its geometry. Pure arithmetic.

The estimate has five parts, each rounded up to whole MiB so the total is their exact sum:

- **weights**: the model's tensor data (from the GGUF header, or Ollama's file size).
- **KV cache**: for each layer that keeps one, elements per token x cells x bytes per
  element. Cells follow llama.cpp's allocator, checked against the KV buffer sizes
  llama-server itself logs (tests/test_footprint_llama_server.py):
  a full-attention layer holds the whole context, per slot rounded up to 256 cells; a
  sliding-window layer holds `min(slot context, window + n_ubatch)` cells per slot,
  rounded up to 256 (llama.cpp keeps one micro-batch beyond the window); with a unified
  cache (`-kvu`, llama-server's default when `-np` is not given) the sliding layers hold
  `min(context, window x slots + n_ubatch)` shared cells. Multi-head latent attention
  caches `kv_lora_rank + rope dims` per token instead of the heads.
- **recurrent state**: hybrid and recurrent models keep, per recurrent layer and per slot,
  a fixed f32 state (llama.cpp's `n_embd_r + n_embd_s`), however long the context.
- **overhead**: a fixed runtime base plus a share of the weights for compute buffers. The
  base is seed 003's runtime overhead: 512 MiB on a GPU (the CUDA context and library
  handles), 1024 MiB in host memory. The share is 10 % of the weights: llama.cpp's compute
  buffer scales with the model's width, and measured 9 % of the weights for Gemma 3 270M
  on the CPU (20.8 MiB compute + 1 MiB output for 235 MiB of weights) and about 5 % for
  an 8B model with flash attention; 10 % covers both. Without flash attention the
  attention scores of one micro-batch grow with the context and can exceed it: the
  margin, or a learned measurement, must cover that.
- **margin**: `margin_pct` (10 % by default) of everything above, for what no formula sees
  (allocator rounding, fragmentation, a runtime newer than these rules).

The estimate is a prior for admission when nothing better is known: a configured
footprint or a learned measurement of a real load always takes precedence.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, Final

import attrs

from vacancyd.footprint.geometry import Geometry

MIB: Final = 1024 * 1024
CELL_PADDING: Final = 256  # llama.cpp rounds every KV cache up to a multiple of 256 cells
DEFAULT_UBATCH: Final = 512  # llama.cpp's default micro-batch (-ub)
GPU_RUNTIME_MIB: Final = 512
HOST_RUNTIME_MIB: Final = 1024
COMPUTE_SHARE_PCT: Final = 10.0
DEFAULT_MARGIN_PCT: Final = 10.0

# Bytes per cached element for llama.cpp's KV cache types (-ctk / -ctv, Ollama's
# OLLAMA_KV_CACHE_TYPE): quantised types store blocks of 32 elements with a scale.
CACHE_TYPE_BYTES: Final[Mapping[str, float]] = {
    "f32": 4.0,
    "f16": 2.0,
    "bf16": 2.0,
    "q8_0": 34 / 32,
    "q5_1": 24 / 32,
    "q5_0": 22 / 32,
    "q4_1": 20 / 32,
    "q4_0": 18 / 32,
    "iq4_nl": 18 / 32,
}


def kv_bytes_per_element(cache_type: str) -> float:
    """Bytes per element of a KV cache type name ("f16", "q8_0", ...); KeyError if unknown."""
    return CACHE_TYPE_BYTES[cache_type.lower()]


@attrs.frozen
class FootprintEstimate:
    """An estimate's parts in MiB, and enough of how they were reached to explain them."""

    architecture: str
    context_tokens: int
    parallel: int
    kv_bytes_per_element: float
    unified_kv: bool
    weights_mib: int
    kv_cache_mib: int
    recurrent_state_mib: int
    overhead_mib: int
    margin_mib: int
    runtime_mib: int
    compute_share_pct: float
    margin_pct: float
    full_layers: int
    full_cells: int
    sliding_layers: int
    sliding_cells: int
    sliding_window: int | None
    recurrent_layers: int
    latent_rank: int | None
    notes: tuple[str, ...] = ()

    @property
    def total_mib(self) -> int:
        return (
            self.weights_mib
            + self.kv_cache_mib
            + self.recurrent_state_mib
            + self.overhead_mib
            + self.margin_mib
        )

    def as_dict(self) -> dict[str, Any]:
        """The parts and totals as plain JSON values, for /status and refusal details."""
        return {
            "architecture": self.architecture,
            "context_tokens": self.context_tokens,
            "parallel": self.parallel,
            "weights_mib": self.weights_mib,
            "kv_cache_mib": self.kv_cache_mib,
            "recurrent_state_mib": self.recurrent_state_mib,
            "overhead_mib": self.overhead_mib,
            "margin_mib": self.margin_mib,
            "total_mib": self.total_mib,
        }

    def explain(self) -> str:
        """Each part on a line with what it is made of, for a person."""
        cache = _cache_type_name(self.kv_bytes_per_element)
        slots = f"{self.parallel} slot{'s' if self.parallel != 1 else ''}"
        rows = [
            ("weights", self.weights_mib, "tensor data of the model file"),
            ("KV cache", self.kv_cache_mib, self._kv_detail() + f", {cache}"),
            ("recurrent state", self.recurrent_state_mib, self._recurrent_detail()),
            (
                "overhead",
                self.overhead_mib,
                f"{self.runtime_mib} MiB runtime + {self.compute_share_pct:g}% of weights "
                "for compute buffers",
            ),
            ("margin", self.margin_mib, f"{self.margin_pct:g}% of the parts above"),
        ]
        lines = [
            f"footprint estimate for {self.architecture} at {self.context_tokens} tokens "
            f"of context ({slots}{', unified KV cache' if self.unified_kv else ''}):"
        ]
        lines += [f"  {name:<16}{mib:>8} MiB  {detail}" for name, mib, detail in rows]
        lines.append(f"  {'total':<16}{self.total_mib:>8} MiB")
        lines += [f"  note: {note}" for note in self.notes]
        return "\n".join(lines)

    def _kv_detail(self) -> str:
        parts = []
        kind = f"latent rank {self.latent_rank} (MLA) " if self.latent_rank is not None else ""
        if self.full_layers:
            parts.append(
                f"{self.full_layers} {kind}full-attention layers x {self.full_cells} cells"
            )
        if self.sliding_layers:
            parts.append(
                f"{self.sliding_layers} sliding-window layers x {self.sliding_cells} cells "
                f"(window {self.sliding_window})"
            )
        return " + ".join(parts) or "no attention layers"

    def _recurrent_detail(self) -> str:
        if not self.recurrent_layers:
            return "no recurrent layers"
        return f"{self.recurrent_layers} recurrent layers x {self.parallel} slots, fixed f32 state"


def estimate(
    geometry: Geometry,
    context_tokens: int,
    parallel: int = 1,
    kv_bytes_per_element: float = 2.0,
    margin_pct: float = DEFAULT_MARGIN_PCT,
    *,
    runtime_mib: int = GPU_RUNTIME_MIB,
    compute_share_pct: float = COMPUTE_SHARE_PCT,
    unified_kv: bool = False,
    ubatch: int = DEFAULT_UBATCH,
) -> FootprintEstimate:
    """The memory a server needs to hold `geometry` with `context_tokens` of KV cache.

    `context_tokens` is the whole cache, shared by `parallel` slots (llama-server's `-c`;
    for Ollama, `num_ctx` x parallel). `kv_bytes_per_element` is 2 for f16 caches; see
    `kv_bytes_per_element()` for quantised ones. `runtime_mib` is GPU_RUNTIME_MIB for a
    GPU, HOST_RUNTIME_MIB for host memory. Raises ValueError for impossible arguments.
    """
    if context_tokens < 1 or parallel < 1 or ubatch < 1:
        raise ValueError("context_tokens, parallel and ubatch must be at least 1")
    if kv_bytes_per_element <= 0 or margin_pct < 0 or compute_share_pct < 0 or runtime_mib < 0:
        raise ValueError("element size must be positive; margin, share and runtime not negative")
    full_cells, sliding_cells = _cells(geometry, context_tokens, parallel, unified_kv, ubatch)
    kv_bytes = 0.0
    for layer in range(geometry.block_count):
        cells = sliding_cells if geometry.sliding_layers[layer] else full_cells
        kv_bytes += geometry.kv_elements_per_token(layer) * cells * kv_bytes_per_element
    recurrent_bytes = geometry.recurrent_layer_count * geometry.recurrent_state_bytes * parallel
    weights_mib = _mib(geometry.weights_bytes)
    kv_mib = _mib(kv_bytes)
    recurrent_mib = _mib(recurrent_bytes)
    overhead_mib = runtime_mib + math.ceil(weights_mib * compute_share_pct / 100)
    subtotal = weights_mib + kv_mib + recurrent_mib + overhead_mib
    return FootprintEstimate(
        architecture=geometry.architecture,
        context_tokens=context_tokens,
        parallel=parallel,
        kv_bytes_per_element=kv_bytes_per_element,
        unified_kv=unified_kv,
        weights_mib=weights_mib,
        kv_cache_mib=kv_mib,
        recurrent_state_mib=recurrent_mib,
        overhead_mib=overhead_mib,
        margin_mib=math.ceil(subtotal * margin_pct / 100),
        runtime_mib=runtime_mib,
        compute_share_pct=compute_share_pct,
        margin_pct=margin_pct,
        full_layers=geometry.full_attention_layer_count,
        full_cells=full_cells,
        sliding_layers=geometry.sliding_layer_count,
        sliding_cells=sliding_cells,
        sliding_window=geometry.sliding_window,
        recurrent_layers=geometry.recurrent_layer_count,
        latent_rank=geometry.kv_lora_rank,
        notes=geometry.notes,
    )


def _cells(
    geometry: Geometry, context: int, parallel: int, unified: bool, ubatch: int
) -> tuple[int, int]:
    """Cells of a full-attention layer and of a sliding-window layer, all slots together."""
    if unified:
        full = _pad(context)
        window = geometry.sliding_window
        sliding = full if window is None else _pad(min(full, window * parallel + ubatch))
        return full, sliding
    per_slot = _pad(math.ceil(context / parallel))
    window = geometry.sliding_window
    sliding_per_slot = per_slot if window is None else _pad(min(per_slot, window + ubatch))
    return per_slot * parallel, sliding_per_slot * parallel


def _pad(cells: int) -> int:
    return -(-cells // CELL_PADDING) * CELL_PADDING


def _mib(size_bytes: float) -> int:
    return math.ceil(size_bytes / MIB)


def _cache_type_name(element_bytes: float) -> str:
    names = [name for name, size in CACHE_TYPE_BYTES.items() if size == element_bytes]
    label = names[0] if names else "custom"
    return f"{label} ({element_bytes:g} bytes/element)"
