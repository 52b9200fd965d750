"""layerpy: network boot and node lifecycle in one asyncio process.

This package is also imported inside the minOS initramfs (``layerpy.agent``), so this
module must stay free of third-party imports.
"""

__version__ = "0.1.0"
