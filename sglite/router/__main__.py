"""`python -m sglite.router [flags]`: the same as `sglite router`."""

import sys

from sglite.router.launch import main

if __name__ == "__main__":
    sys.exit(main(prog="python -m sglite.router"))
