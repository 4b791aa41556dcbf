"""The decode worker: imports handed-off KV and generates with continuous batching."""
