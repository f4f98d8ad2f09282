"""`python -m sglite.launch_server [flags]`: SGLang's way to start the server, same flags."""

from __future__ import annotations

import sys

from sglite.cli import serve

if __name__ == "__main__":
    sys.exit(serve(prog="python -m sglite.launch_server"))
