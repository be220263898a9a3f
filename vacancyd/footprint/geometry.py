"""A model's geometry: the few numbers that decide how much memory serving it takes.

Pure: built from a GGUF file's metadata table (`geometry_from_gguf_fields`) or from
Ollama's `/api/show` `model_info`, which is that same table with the same `<arch>.` key
names (`geometry_from_ollama_model_info`). No I/O here, so the rules can be tested as
tables and the same code serves the CLI and the daemon.

What decides the memory of a loaded model, beyond its weights, is its KV cache, and the
cache depends on more than "layers x heads x head size":

- grouped-query attention keeps `head_count_kv` heads per layer, not `head_count`, and
  some files give one count per layer (0 where a layer has no attention at all);
- multi-head latent attention (DeepSeek 2/3, Kimi K2, GLM 4.7 Lite) caches one latent
  vector of `kv_lora_rank` plus the rope dimensions per token and layer, not the heads;
- sliding-window layers never cache more than their window (Gemma 3 interleaves five of
  them with one global layer; which layers slide is architecture knowledge, see
  `architectures`);
- hybrid models (Qwen3-Next, Jamba, Granite 4 hybrid, Nemotron-H, LFM2, Mamba and RWKV)
  cache keys and values only on their attention layers; their recurrent layers keep a
  fixed state per sequence, however long the context.

Every default or assumption taken is recorded in `notes`, so `explain()` can say why a
number is what it is. Where the file leaves a fact open, the choice made is the one that
charges more memory, never less.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any, Final

import attrs

from vacancyd.footprint import architectures as arch_rules

# Bounds that keep a corrupt or hostile table from turning into absurd arithmetic.
MAX_LAYERS: Final = 4096
MAX_DIMENSION: Final = 1 << 24
MAX_WEIGHTS_BYTES: Final = 1 << 50

RECURRENT_STATE_ELEMENT_BYTES: Final = 4  # llama.cpp keeps recurrent states in f32

# Bytes per parameter by GGUF `general.file_type` (llama.cpp's LLAMA_FTYPE), used only when
# Ollama reports no file size. Each is the format's nominal bits per weight, rounded up.
_FILE_TYPE_BYTES_PER_PARAMETER: Final[Mapping[int, float]] = {
    0: 4.0,  # F32
    1: 2.0,  # F16
    2: 0.5625,  # Q4_0
    3: 0.625,  # Q4_1
    7: 1.0625,  # Q8_0
    8: 0.6875,  # Q5_0
    9: 0.75,  # Q5_1
    10: 0.375,  # Q2_K
    11: 0.4375,  # Q3_K_S
    12: 0.5,  # Q3_K_M
    13: 0.5625,  # Q3_K_L
    14: 0.5625,  # Q4_K_S
    15: 0.625,  # Q4_K_M
    16: 0.6875,  # Q5_K_S
    17: 0.75,  # Q5_K_M
    18: 0.875,  # Q6_K
    32: 2.0,  # BF16
}
_UNKNOWN_FILE_TYPE_BYTES: Final = 2.0


class GeometryError(ValueError):
    """The metadata does not describe a model whose memory we can estimate; says why."""


@attrs.frozen
class Geometry:
    """What sizes a model's memory. Per-layer facts are tuples of length `block_count`.

    `head_count` and `head_count_kv` are one number for all layers or one per layer, as
    the file gives them. `kv_lora_rank` is set only where the runtime caches the MLA
    latent (the file carries `attention.key_length_mla`); then every attention layer
    caches `kv_lora_rank + rope_dimension_count` elements per token and nothing else.
    `recurrent_state_bytes` is the fixed state of one recurrent layer for one sequence.
    `weights_bytes` is the tensor data (or, failing that, the file size).
    """

    architecture: str
    block_count: int
    weights_bytes: int
    head_count: int | tuple[int, ...]
    head_count_kv: int | tuple[int, ...]
    key_length: int
    value_length: int
    attention_layers: tuple[bool, ...]
    sliding_layers: tuple[bool, ...]
    recurrent_layers: tuple[bool, ...]
    embedding_length: int | None = None
    key_length_swa: int | None = None
    value_length_swa: int | None = None
    kv_lora_rank: int | None = None
    rope_dimension_count: int | None = None
    sliding_window: int | None = None
    recurrent_state_bytes: int = 0
    context_length: int | None = None
    vocab_size: int | None = None
    notes: tuple[str, ...] = ()

    @property
    def is_mla(self) -> bool:
        return self.kv_lora_rank is not None

    def kv_heads(self, layer: int) -> int:
        return _at(self.head_count_kv, layer)

    def kv_elements_per_token(self, layer: int) -> int:
        """Elements (keys and values together) one token adds to this layer's cache."""
        if not self.attention_layers[layer]:
            return 0
        if self.kv_lora_rank is not None:
            return self.kv_lora_rank + (self.rope_dimension_count or 0)
        key, value = self.key_length, self.value_length
        if self.sliding_layers[layer]:
            key = self.key_length_swa or key
            value = self.value_length_swa or value
        return self.kv_heads(layer) * (key + value)

    @property
    def full_attention_layer_count(self) -> int:
        return sum(
            a and not s for a, s in zip(self.attention_layers, self.sliding_layers, strict=True)
        )

    @property
    def sliding_layer_count(self) -> int:
        return sum(a and s for a, s in zip(self.attention_layers, self.sliding_layers, strict=True))

    @property
    def recurrent_layer_count(self) -> int:
        return sum(self.recurrent_layers)


def geometry_from_gguf_fields(fields: Mapping[str, Any], weights_bytes: int) -> Geometry:
    """The geometry in a GGUF metadata table (key -> value; arrays as sequences).

    An array the reader left unread may stand in as any object with a length (only the
    tokenizer's token list is read that way, for the vocabulary size). Raises
    GeometryError naming the key that is missing or malformed.
    """
    return _Parser(fields, weights_bytes, elided_arrays=False).geometry()


def geometry_from_ollama_model_info(
    model_info: Mapping[str, Any], size_bytes: int | None
) -> Geometry:
    """The geometry in Ollama's `/api/show` `model_info` (GGUF keys, JSON values).

    `size_bytes` is the model's size from `/api/tags`. Without it the weights are taken
    as `general.parameter_count` times the nominal bytes per weight of
    `general.file_type` (2 bytes, f16, when the type is unknown), which is noted.
    Without `verbose`, Ollama replaces arrays longer than 5 with `[]`: an empty array is
    treated as absent, and the conservative default for that fact is used and noted.
    """
    notes: list[str] = []
    if size_bytes is None:
        weights = _weights_from_parameters(model_info)
        notes.append(
            "weights estimated from general.parameter_count and general.file_type: "
            "Ollama reported no file size"
        )
    else:
        weights = size_bytes
    parser = _Parser(model_info, weights, elided_arrays=True)
    parser.notes.extend(notes)
    return parser.geometry()


def _weights_from_parameters(model_info: Mapping[str, Any]) -> int:
    parameters = _as_int(model_info.get("general.parameter_count"), "general.parameter_count")
    if parameters is None:
        raise GeometryError(
            "model_info has no general.parameter_count and no file size was given: "
            "the weights cannot be sized"
        )
    file_type = _as_int(model_info.get("general.file_type"), "general.file_type")
    per_parameter = _FILE_TYPE_BYTES_PER_PARAMETER.get(
        file_type if file_type is not None else -1, _UNKNOWN_FILE_TYPE_BYTES
    )
    return math.ceil(parameters * per_parameter)


class _Parser:
    """One pass over one metadata table; collects the notes of every default it takes."""

    def __init__(self, fields: Mapping[str, Any], weights_bytes: int, *, elided_arrays: bool):
        self.fields = fields
        self.weights_bytes = weights_bytes
        self.elided_arrays = elided_arrays
        self.notes: list[str] = []
        architecture = fields.get("general.architecture")
        if not isinstance(architecture, str) or not architecture:
            raise GeometryError("general.architecture is missing or not a string")
        self.arch = architecture
        self.layers = 0

    def key(self, name: str) -> str:
        return f"{self.arch}.{name}"

    def raw(self, name: str) -> Any:
        value = self.fields.get(self.key(name))
        if self.elided_arrays and isinstance(value, list) and not value:
            self.notes.append(f"{self.key(name)} was elided by Ollama (an array); not used")
            return None
        return value

    def scalar(self, name: str) -> int | None:
        return _as_int(self.raw(name), self.key(name))

    def per_layer(self, name: str) -> int | tuple[int, ...] | None:
        value = self.raw(name)
        if isinstance(value, Sequence) and not isinstance(value, str | bytes):
            items = tuple(_as_int(v, self.key(name)) for v in value)
            if len(items) != self.layers or any(v is None for v in items):
                raise GeometryError(
                    f"{self.key(name)} has {len(items)} entries for {self.layers} layers"
                )
            return tuple(v for v in items if v is not None)
        return _as_int(value, self.key(name))

    def geometry(self) -> Geometry:
        if not 0 <= self.weights_bytes <= MAX_WEIGHTS_BYTES:
            raise GeometryError(f"weights of {self.weights_bytes} bytes are out of range")
        layers = self.scalar("block_count")
        if layers is None or not 1 <= layers <= MAX_LAYERS:
            raise GeometryError(f"{self.key('block_count')} is missing or out of range")
        self.layers = layers
        embedding = self.scalar("embedding_length")
        heads = self.per_layer("attention.head_count")
        kv_heads = self.per_layer("attention.head_count_kv")
        if heads is None:
            if self.arch not in arch_rules.PURELY_RECURRENT:
                raise GeometryError(f"{self.key('attention.head_count')} is missing")
            heads = 0
        if kv_heads is None:
            kv_heads = heads
        key_length, value_length = self.head_lengths(embedding, heads)
        recurrent, attention = self.layer_kinds(kv_heads)
        mla_rank, rope = self.latent()
        window, sliding = self.sliding(attention, recurrent)
        return Geometry(
            architecture=self.arch,
            block_count=layers,
            weights_bytes=self.weights_bytes,
            head_count=heads,
            head_count_kv=kv_heads,
            key_length=key_length,
            value_length=value_length,
            attention_layers=attention,
            sliding_layers=sliding,
            recurrent_layers=recurrent,
            embedding_length=embedding,
            key_length_swa=self.scalar("attention.key_length_swa"),
            value_length_swa=self.scalar("attention.value_length_swa"),
            kv_lora_rank=mla_rank,
            rope_dimension_count=rope,
            sliding_window=window,
            recurrent_state_bytes=self.recurrent_state_bytes(embedding, heads, recurrent),
            context_length=self.scalar("context_length"),
            vocab_size=self.vocab_size(),
            notes=tuple(dict.fromkeys(self.notes)),
        )

    def head_lengths(self, embedding: int | None, heads: int | tuple[int, ...]) -> tuple[int, int]:
        """Key and value head sizes; both default to embedding / heads, as in llama.cpp."""
        key = self.scalar("attention.key_length")
        value = self.scalar("attention.value_length")
        if key is not None and value is not None:
            return key, value
        first_heads = next((h for h in _each(heads, self.layers) if h > 0), 0)
        if embedding is None or first_heads == 0:
            if self.arch in arch_rules.PURELY_RECURRENT:
                return key or 0, value or key or 0
            raise GeometryError(
                f"{self.key('attention.key_length')} is missing and cannot be derived "
                f"without {self.key('embedding_length')} and a head count"
            )
        derived = embedding // first_heads
        return (key if key is not None else derived), (value if value is not None else derived)

    def latent(self) -> tuple[int | None, int | None]:
        """MLA: llama.cpp caches the latent only for files converted with key_length_mla."""
        rank = self.scalar("attention.kv_lora_rank")
        if rank is None:
            return None, None
        if self.scalar("attention.key_length_mla") is None:
            self.notes.append(
                f"{self.key('attention.kv_lora_rank')} without key_length_mla: an older "
                "conversion that llama.cpp runs as full multi-head attention; sized that way"
            )
            return None, None
        rope = self.scalar("rope.dimension_count")
        key = self.scalar("attention.key_length")
        if rope is None and key is not None and key > rank:
            rope = key - rank
        return rank, rope or 0

    def layer_kinds(
        self, kv_heads: int | tuple[int, ...]
    ) -> tuple[tuple[bool, ...], tuple[bool, ...]]:
        """Per layer: does it keep a recurrent state, and does it keep a KV cache?"""
        n = self.layers
        recurrent = self.recurrent_pattern(kv_heads)
        if self.arch in arch_rules.PARALLEL_HYBRID:
            attention = tuple(h > 0 for h in _each(kv_heads, n))
        else:
            attention = tuple(
                h > 0 and not r for h, r in zip(_each(kv_heads, n), recurrent, strict=True)
            )
        return recurrent, attention

    def recurrent_pattern(self, kv_heads: int | tuple[int, ...]) -> tuple[bool, ...]:
        n, arch = self.layers, self.arch
        marked = self.raw("attention.recurrent_layers")
        if isinstance(marked, Sequence) and not isinstance(marked, str | bytes):
            if len(marked) != n:
                raise GeometryError(
                    f"{self.key('attention.recurrent_layers')} has {len(marked)} entries "
                    f"for {n} layers"
                )
            return tuple(bool(v) for v in marked)
        if arch in arch_rules.PURELY_RECURRENT or arch in arch_rules.PARALLEL_HYBRID:
            return (True,) * n
        interval = self.scalar("full_attention_interval")
        if interval is None and arch in arch_rules.INTERVAL_HYBRID:
            interval = arch_rules.INTERVAL_HYBRID[arch]
            self.notes.append(
                f"full attention every {interval} layers (llama.cpp's default for {arch})"
            )
        if interval is not None and interval > 0:
            return tuple((i + 1) % interval != 0 for i in range(n))
        if arch in arch_rules.ZERO_KV_HEADS_HYBRID and isinstance(kv_heads, tuple):
            return self.zero_head_layers(kv_heads)
        if self.has_recurrent_keys():
            self.notes.append(
                f"{arch} has recurrent-state keys but no layer pattern we know: every "
                "layer is charged both a KV cache and a recurrent state"
            )
            return (True,) * n
        return (False,) * n

    def zero_head_layers(self, kv_heads: tuple[int, ...]) -> tuple[bool, ...]:
        recurrent = tuple(h == 0 for h in kv_heads)
        if self.arch in arch_rules.ZERO_FFN_ALSO_REQUIRED:
            ffn = self.per_layer("feed_forward_length")
            if isinstance(ffn, tuple):
                recurrent = tuple(r and f == 0 for r, f in zip(recurrent, ffn, strict=True))
        return recurrent

    def has_recurrent_keys(self) -> bool:
        prefixes = (self.key("ssm."), self.key("wkv."), self.key("shortconv."), self.key("kda."))
        return any(isinstance(k, str) and k.startswith(prefixes) for k in self.fields)

    def recurrent_state_bytes(
        self, embedding: int | None, heads: int | tuple[int, ...], recurrent: tuple[bool, ...]
    ) -> int:
        """One recurrent layer's state for one sequence (llama.cpp n_embd_r + n_embd_s)."""
        if not any(recurrent):
            return 0
        n_embd = embedding or 0
        rolling, state = 0, 0
        wkv = self.scalar("wkv.head_size")
        short_conv = self.scalar("shortconv.l_cache")
        kda = self.scalar("kda.head_dim")
        conv = self.scalar("ssm.conv_kernel") or 0
        if wkv:  # RWKV: token-shift rows and the wkv state
            rolling = (self.scalar("token_shift_count") or 2) * n_embd
            state = n_embd * wkv
        elif short_conv:  # LFM2 short convolutions: a rolling window only
            rolling = n_embd * (short_conv - 1)
        elif kda:  # Kimi delta attention
            head_count = _at(heads, 0)
            rolling = 3 * (conv - 1 if conv > 0 else 3) * head_count * kda
            state = kda * kda * head_count
        else:  # Mamba-style blocks (Mamba 1/2, Jamba, Granite hybrid, Qwen3-Next, ...)
            inner = self.scalar("ssm.inner_size") or 0
            state_size = self.scalar("ssm.state_size") or 0
            groups = self.scalar("ssm.group_count") or 0
            rolling = max(conv - 1, 0) * (inner + 2 * groups * state_size)
            state = state_size * inner
        if rolling + state == 0:
            self.notes.append("recurrent layers without state-size keys: their state is not sized")
        return (rolling + state) * RECURRENT_STATE_ELEMENT_BYTES

    def sliding(
        self, attention: tuple[bool, ...], recurrent: tuple[bool, ...]
    ) -> tuple[int | None, tuple[bool, ...]]:
        """The window and which layers use it; none where llama.cpp would use none."""
        n, arch = self.layers, self.arch
        none = (False,) * n
        window = self.scalar("attention.sliding_window")
        rule = arch_rules.SLIDING_RULES.get(arch)
        if arch in arch_rules.SLIDING_WINDOW_IGNORED:
            if window:
                self.notes.append(f"{arch}: llama.cpp ignores the sliding window; not applied")
            return None, none
        if rule is not None and rule.default_window is not None:
            if window == 0:
                return None, none
            if window is None or rule.fixed_window:
                window = rule.default_window
        if not window:
            return None, none
        if arch in arch_rules.SLIDING_ON_EVERY_ATTENTION_LAYER:
            return window, tuple(a and not r for a, r in zip(attention, recurrent, strict=True))
        pattern = self.raw("attention.sliding_window_pattern")
        if isinstance(pattern, Sequence) and not isinstance(pattern, str | bytes):
            if len(pattern) != n:
                raise GeometryError(
                    f"{self.key('attention.sliding_window_pattern')} has {len(pattern)} "
                    f"entries for {n} layers"
                )
            return window, tuple(bool(v) for v in pattern)
        period = _as_int(pattern, self.key("attention.sliding_window_pattern"))
        if rule is None:
            if period is None:
                self.notes.append(
                    f"{arch} has a sliding window but no layer pattern we know: "
                    "every layer is charged the whole context"
                )
                return None, none
            rule = arch_rules.SlidingRule(period)
        return window, tuple(rule.is_sliding(i, period) for i in range(n))

    def vocab_size(self) -> int | None:
        size = self.scalar("vocab_size")
        if size is not None:
            return size
        tokens = self.fields.get("tokenizer.ggml.tokens")
        if tokens is not None and hasattr(tokens, "__len__") and len(tokens) > 0:
            return len(tokens)
        return None


def _as_int(value: Any, key: str) -> int | None:
    """A non-negative integer (JSON may carry 32.0), None when absent; else GeometryError."""
    if value is None:
        return None
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if not isinstance(value, int) or not 0 <= value <= MAX_DIMENSION * MAX_DIMENSION:
        raise GeometryError(f"{key} is not a non-negative integer: {value!r}")
    return value


def _at(value: int | tuple[int, ...], layer: int) -> int:
    return value[layer] if isinstance(value, tuple) else value


def _each(value: int | tuple[int, ...], layers: int) -> tuple[int, ...]:
    return value if isinstance(value, tuple) else (value,) * layers
