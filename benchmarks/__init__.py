"""Benchmarks that compare pdserve with Hugging Face transformers and with the machine's limits."""
