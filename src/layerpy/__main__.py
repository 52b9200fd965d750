from layerpy.cli import main

main()
