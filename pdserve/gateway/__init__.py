"""The public gRPC endpoint: tokenizes, routes each request to a prefill and a decode worker, relays tokens."""
