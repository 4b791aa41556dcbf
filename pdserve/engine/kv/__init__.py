"""Everything the engine does with KV: blocks, pages, the cache tensors, leases, pushes and the connector.

- ``block_manager``: the paged pool's block accounting, prefix cache and its LRU eviction.
- ``pages``: page groups for sliding-window layers (what a window has left behind is freed).
- ``cache``: the preallocated KV tensors (and int8 scales); export and import of blocks.
- ``handoff``: the torch side of a handoff (a layout's tensor dtype, ``KVFetch``); the descriptors
  themselves are value types in ``pdserve.engine.types.handoff``.
- ``leases``: a prefill engine's finished requests whose blocks stay pinned for a decode worker.
- ``push``: each layer's KV handed to a sink while the prefill computes.
- ``connector``: the decode side of a handoff (vLLM v1's ``KVConnector`` shape): requests waiting for
  remote KV, pushes landing, pulled KV written.

Layered inside too (``lint-imports``): the connector over leases and push, over
pages, cache and handoff, over the block manager.
"""
