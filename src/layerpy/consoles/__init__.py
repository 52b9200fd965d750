"""Nodes' serial consoles: captured, watched for dying kernels, attached to by operators."""

from layerpy.consoles.capture import Consoles, Notice

__all__ = ["Consoles", "Notice"]
