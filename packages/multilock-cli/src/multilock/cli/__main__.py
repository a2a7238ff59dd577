"""``python -m multilock.cli``: the same as the ``multilock`` command."""

import sys

from ._app import main

sys.exit(main())
