"""Model loading and the batched forward over a slot KV cache."""
