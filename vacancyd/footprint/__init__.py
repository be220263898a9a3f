"""Footprints without hand measurement: estimate a model's memory from its geometry, and
learn what real loads took.

- `geometry`: the numbers that size a model, from GGUF metadata or Ollama's `model_info`;
- `gguf_reader`: a bounded reader of GGUF headers (blocking; numpy through `gguf`, so it
  is not imported here);
- `estimate`: weights, KV cache, recurrent state, overhead and margin, in MiB;
- `served`: what a running server serves (geometry, context, KV cache type, identity),
  read and sized the same way for admission and the CLI;
- `processes`: the server's process tree: its RSS and its environment;
- `learned`: measured footprints kept across restarts;
- `book`: the daemon's learned-else-estimated footprints, and loads it measures;
- `command`: the `vacancyd footprint` CLI.
"""

from vacancyd.footprint.estimate import FootprintEstimate, estimate, kv_bytes_per_element
from vacancyd.footprint.geometry import (
    Geometry,
    GeometryError,
    geometry_from_gguf_fields,
    geometry_from_ollama_model_info,
)
from vacancyd.footprint.learned import LearnedFootprints

__all__ = [
    "FootprintEstimate",
    "Geometry",
    "GeometryError",
    "LearnedFootprints",
    "estimate",
    "geometry_from_gguf_fields",
    "geometry_from_ollama_model_info",
    "kv_bytes_per_element",
]
