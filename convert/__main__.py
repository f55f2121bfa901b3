import sys

from ott_gguf.errors import OttError

from . import main

try:
    sys.exit(main())
except OttError as e:
    print(f"error: {e}", file=sys.stderr)
    sys.exit(1)
