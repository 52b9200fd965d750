"""``python -m layerpy.agent``: what the minOS inittab respawns."""

from layerpy.agent.core import main

if __name__ == "__main__":
    main()
