"""``python -m psr_hf.cli``: the ``psr-hf`` command."""

import sys

from . import main

if __name__ == "__main__":  # importing this module (as a walk over the package does) runs nothing
    sys.exit(main())
