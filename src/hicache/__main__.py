import sys

from hicache.cli import main

# Guarded: the engine's process (multiprocessing's spawn) imports this module again.
if __name__ == "__main__":
    sys.exit(main())
