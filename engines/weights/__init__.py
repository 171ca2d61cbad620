"""A transformer's weights: each tp rank's share read from safetensors, and LoRA adapters on top."""
