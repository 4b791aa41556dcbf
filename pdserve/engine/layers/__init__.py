"""Layers whose storage and arithmetic depend on the precision: the linear methods (pdserve/engine/layers/linear.py)."""
