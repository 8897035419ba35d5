"""Measuring a model, an adapter and the machine: `retrograd bench` (base against adapter,
likelihood and rollout benches) and preflight's probe."""
