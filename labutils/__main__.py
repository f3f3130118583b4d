import os
import sys

from .tools.cli import main

code = main()  # after a Ctrl-C's one line, exit at once: shutting down could still die of the SIGINT (exit -2)
os._exit(sys.stdout.flush() or sys.stderr.flush() or 130) if code == 130 else sys.exit(code)
