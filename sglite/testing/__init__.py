"""Builders of tiny random models for tests and benchmarks, like `torch.testing`."""
