"""The user's guide: the MkDocs site builds cleanly, the README and BENCHMARKS.md stay short, no dated provenance."""
