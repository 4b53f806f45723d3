"""`python -m specmtp`: the same as the `specmtp` command."""

import sys

from specmtp.cli import main

sys.exit(main())
