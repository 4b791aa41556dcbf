"""The prefill worker: runs prompts, samples the first token, holds the KV under a lease for a decode worker."""
