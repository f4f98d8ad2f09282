"""Architecture hyper-parameters of a decoder-only model, independent of the weight format.

Both loaders (GGUF metadata and Hugging Face `config.json`) produce a `ModelConfig`; the model
code reads nothing else.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

# Architectures the model code implements, by the Hugging Face class name. GGUF architectures map
# onto these (see gguf_loader.GGUF_ARCHS).
SUPPORTED_ARCHS: tuple[str, ...] = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")


@dataclass
class ModelConfig:
    """Hyper-parameters of a Llama-family or Qwen2 model.

    `rope_scaling` follows the Hugging Face dict shape (`rope_type` plus its parameters), or is
    None for plain RoPE. GGUF files that store explicit per-frequency divisors use
    `{"rope_type": "freq_factors", "factors": [...]}`.
    """

    arch: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # bias on q/k/v (Qwen2; Llama with attention_bias=True)
    o_proj_bias: bool = False  # Llama's attention_bias also covers o_proj, Qwen2's does not
    mlp_bias: bool = False
    # Sliding-window attention (Mistral v0.1, Qwen2 with use_sliding_window): window length and
    # which layers use it (None = all layers when sliding_window is set).
    sliding_window: int | None = None
    sliding_window_layers: list[int] | None = None
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads != 0:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of "
                f"num_kv_heads ({self.num_kv_heads})"
            )

    def layer_sliding_window(self, layer: int) -> int | None:
        """The attention window of one layer, or None for full attention."""
        if self.sliding_window is None:
            return None
        if self.sliding_window_layers is not None and layer not in self.sliding_window_layers:
            return None
        return self.sliding_window

    @property
    def q_size(self) -> int:
        """Width of the query projection output."""
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        """Width of each of the key and value projection outputs."""
        return self.num_kv_heads * self.head_dim
