"""``python -m jaxdp.launch``."""

import sys

from ._launcher import main

if __name__ == "__main__":
    sys.exit(main())
