"""Architecture hyper-parameters of a decoder-only model, independent of the weight format.

Each family (`models/`) builds a `ModelConfig` from GGUF metadata or a Hugging Face
`config.json`; the shared layers read nothing else. Where families differ (q/k norms, norms
around each block, the MLP's activation, per-layer windows and RoPE bases, experts), the
difference is a field here, never a test of the family's name in the forward pass.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

ACTIVATIONS = ("silu", "gelu_tanh")


@dataclass
class ModelConfig:
    """Hyper-parameters of one decoder-only transformer.

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
    # Sliding-window attention (Mistral v0.1, Qwen2 with use_sliding_window, Gemma 3's local
    # layers): window length and which layers use it (None = all layers when sliding_window is
    # set). A window of W lets a token attend to itself and the W - 1 tokens before it.
    sliding_window: int | None = None
    sliding_window_layers: list[int] | None = None
    # RoPE of the sliding-window layers when it differs from the global one (Gemma 3: base
    # 10,000 locally, 1,000,000 globally); None = the same as every other layer.
    local_rope_theta: float | None = None
    local_rope_scaling: dict[str, Any] | None = None
    # RMSNorm of each query and key head before RoPE (Qwen3, Gemma 3).
    qk_norm: bool = False
    # Norms of the attention and MLP outputs before they join the residual stream (Gemma 3).
    sandwich_norms: bool = False
    # The gated MLP's activation: silu (SwiGLU) or gelu_tanh (GeGLU, Gemma).
    hidden_act: str = "silu"
    # Token embeddings are multiplied by this (Gemma: sqrt(hidden_size)).
    embedding_multiplier: float = 1.0
    # Attention logits are scaled by this; None = head_dim ** -0.5.
    attention_scale: float | None = None
    # Mixture of experts (Mixtral, Qwen3-MoE): experts per MoE layer, how many each token uses,
    # their MLP width, whether the chosen experts' weights are renormalized to sum to 1, and
    # which layers are MoE (None = all of them when num_experts > 0; the rest are dense).
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True
    moe_layers: list[int] | None = None
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads != 0:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of "
                f"num_kv_heads ({self.num_kv_heads})"
            )
        if self.hidden_act not in ACTIVATIONS:
            raise ValueError(
                f"unsupported hidden_act {self.hidden_act!r}; supported: {', '.join(ACTIVATIONS)}"
            )
        if self.num_experts and not 0 < self.num_experts_per_tok <= self.num_experts:
            raise ValueError(
                f"num_experts_per_tok ({self.num_experts_per_tok}) must be between 1 and "
                f"num_experts ({self.num_experts})"
            )

    def layer_sliding_window(self, layer: int) -> int | None:
        """The attention window of one layer, or None for full attention."""
        if self.sliding_window is None:
            return None
        if self.sliding_window_layers is not None and layer not in self.sliding_window_layers:
            return None
        return self.sliding_window

    def layer_uses_local_rope(self, layer: int) -> bool:
        """Whether this layer rotates with the local RoPE (`local_rope_theta`)."""
        return self.local_rope_theta is not None and self.layer_sliding_window(layer) is not None

    def layer_is_moe(self, layer: int) -> bool:
        """Whether this layer's MLP is a mixture of experts."""
        if not self.num_experts:
            return False
        return self.moe_layers is None or layer in self.moe_layers

    @property
    def q_size(self) -> int:
        """Width of the query projection output."""
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        """Width of each of the key and value projection outputs."""
        return self.num_kv_heads * self.head_dim
