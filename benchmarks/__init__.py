"""Benchmarks of vision_mlp_bwd against XLA (run `python -m benchmarks.run`)."""
