"""Nodes' serial consoles: captured, watched for dying kernels, attached to by operators."""

from layerpy.consoles.capture import Consoles, Notice
from layerpy.consoles.link import KEYSTROKES

__all__ = ["KEYSTROKES", "Consoles", "Notice"]
