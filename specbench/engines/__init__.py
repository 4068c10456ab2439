"""Engine mode (`run --engine vllm`): presets translated into vLLM's speculative_config, one engine process per
method, vLLM's counts read as our steps, and concurrency sweeps."""
