"""Target runtime (lean Llama with a KV cache) and the EAGLE-style drafter."""
