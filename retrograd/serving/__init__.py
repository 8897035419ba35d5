"""A model behind HTTP: `retrograd serve` (OpenAI-compatible, over inference.py's engine)
and `retrograd rollout-worker` (the sampler for a remote trainer)."""
