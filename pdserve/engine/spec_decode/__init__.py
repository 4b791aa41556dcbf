"""Speculative decoding: proposers (n-gram, draft model) and the verification around the engine's step.

``SpeculativeConfig`` (pdserve/engine/types/speculative.py) says which; ``SpecDecoder`` (decoder.py)
proposes after each step (``build_spec_decoder`` makes one for an engine) and keeps the verified part of each run; the model
runner scores a proposal as extra query tokens of the sequence in the same
forward as the rest of the batch.
"""

from __future__ import annotations
