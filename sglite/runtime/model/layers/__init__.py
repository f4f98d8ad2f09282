"""The layers every model family is built from: norms, self-attention over the paged KV pool,
the gated MLP, the mixture-of-experts MLP, and the decoder block that joins them. What varies
between families is read from `ModelConfig`."""
