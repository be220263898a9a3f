"""What llama.cpp knows about an architecture that its GGUF file does not say.

A GGUF file names its architecture and carries most of the geometry, but a few facts that
decide the size of the KV cache live only in llama.cpp's per-architecture loader code
(`src/models/<arch>.cpp` in llama.cpp): which layers use a sliding window (Gemma 3 files
carry the window, `attention.sliding_window`, but not the 5-sliding-to-1-global
interleave), and which layers of a hybrid model are recurrent (Qwen3-Next files may omit
`full_attention_interval`, whose default of 4 is in the loader). These tables restate those
facts, read from the llama.cpp sources, so that an estimate neither charges a sliding layer
for the whole context nor forgets that a hybrid's attention layers still grow with it.

An architecture missing here is sized conservatively by the caller: every layer a
full-attention layer. That over-charges a model we do not know; it never under-charges one.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Final

import attrs


@attrs.frozen
class SlidingRule:
    """How an architecture interleaves sliding-window and full-attention layers.

    With `period` p, llama.cpp's `set_swa_pattern(p, dense_first)` makes layer i sliding
    when `i % p < p - 1` (the full layer ends each group: Gemma 3's 5 sliding, 1 global),
    or, with `dense_first`, when `i % p != 0` (the full layer starts each group).
    `default_window` is the window llama.cpp assumes when the file gives none; with
    `fixed_window` it uses that window whatever a positive file value says (Llama 4).
    """

    period: int
    dense_first: bool = False
    default_window: int | None = None
    fixed_window: bool = False

    def is_sliding(self, layer: int, period: int | None = None) -> bool:
        p = self.period if period is None else period
        if p == 0:
            return True
        if self.dense_first:
            return layer % p != 0
        return layer % p < p - 1


SLIDING_RULES: Final[Mapping[str, SlidingRule]] = {
    "gemma2": SlidingRule(2, default_window=4096),
    "gemma3": SlidingRule(6),
    "gemma3n": SlidingRule(5),
    "gemma-embedding": SlidingRule(6),
    "cohere2": SlidingRule(4),
    "cohere2moe": SlidingRule(4, dense_first=True),
    "exaone4": SlidingRule(4),
    "exaone-moe": SlidingRule(4),
    "llama4": SlidingRule(4, default_window=8192, fixed_window=True),
    "olmo2": SlidingRule(4),
    "gpt-oss": SlidingRule(2),
    "afmoe": SlidingRule(4),
    "smallthinker": SlidingRule(4, dense_first=True),
    "plamo3": SlidingRule(8),
    "modern-bert": SlidingRule(3, dense_first=True),
}

# Files of these carry a sliding window that llama.cpp does not apply (phi3's loader marks
# every layer full attention), so the whole context is cached on every layer.
SLIDING_WINDOW_IGNORED: Final = frozenset({"phi3"})

# Architectures whose sliding window covers every attention layer (LFM2: the layers that
# are not short convolutions).
SLIDING_ON_EVERY_ATTENTION_LAYER: Final = frozenset({"lfm2", "lfm2moe"})

# Every layer is recurrent and none keeps a KV cache (llama.cpp `llm_arch_is_recurrent`).
PURELY_RECURRENT: Final = frozenset({"mamba", "mamba2", "rwkv6", "rwkv6qwen2", "rwkv7", "arwkv7"})

# Every layer runs attention and a state-space block side by side: both caches everywhere.
PARALLEL_HYBRID: Final = frozenset({"falcon-h1"})

# A full-attention layer every `interval` layers (the last of each group); the others are
# linear-attention layers with a fixed state. The value is llama.cpp's default interval.
INTERVAL_HYBRID: Final[Mapping[str, int]] = {"qwen3next": 4, "qwen35": 4, "qwen35moe": 4}

# A layer is recurrent where the per-layer `attention.head_count_kv` is 0.
ZERO_KV_HEADS_HYBRID: Final = frozenset(
    {"jamba", "granitehybrid", "nemotron_h", "nemotron_h_moe", "lfm2", "lfm2moe", "plamo2"}
)

# ... and, for these, only where the per-layer `feed_forward_length` is 0 as well: a layer
# with neither attention heads nor a recurrent block is a plain MLP layer with no state.
ZERO_FFN_ALSO_REQUIRED: Final = frozenset({"nemotron_h", "nemotron_h_moe"})
