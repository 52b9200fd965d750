"""The minOS agent: reports this node to the layerpy server, forever.

Standard library only (plus ``layerpy.proto``): it runs inside the initramfs, where every
imported module is carried in the image, so imports are kept few and cheap.
"""

from layerpy.agent.core import Agent, Log, main, post_json, read_cmdline

__all__ = ["Agent", "Log", "main", "post_json", "read_cmdline"]
