"""Generated stubs of pdserve's public API, ``protos/pdserve/v1/generation.proto`` (``scripts/gen_protos.sh``)."""
