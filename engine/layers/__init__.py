"""Layers whose storage and arithmetic depend on the precision: the linear methods (engine/layers/linear.py)."""
