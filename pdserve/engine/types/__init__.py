"""The engine's value types: the bottom layer, torch-free, importing no other engine module.

What a caller hands the engine and gets back, and what crosses a process: a
request's parameters (``sampling_params``, ``structured_outputs``, ``lora``),
the engine's configuration (``config``, ``speculative``), the block hash every
process computes alike (``hashing``), the KV layout and handoff records
(``handoff``), outputs and errors. The gateway and the services import them
without loading torch or the model code; ``lint-imports`` (the
``[tool.importlinter]`` contracts in pyproject.toml) keeps it so.
"""
