"""The minOS agent: reports this node to the layerpy server, forever.

Standard library only (plus ``layerpy.proto``): it runs inside the initramfs, where every
imported module is carried in the image, so imports are kept few and cheap.
"""

from layerpy.agent.cmdline import Config, parse_cmdline, read_cmdline
from layerpy.agent.core import Agent, Log, main, post_json

__all__ = ["Agent", "Config", "Log", "main", "parse_cmdline", "post_json", "read_cmdline"]
