"""``python -m multilock``: the same as the ``multilock`` command.

``multilock`` is a PEP 420 namespace shared by every multilock distribution, so this module
is its only file outside a subpackage, and it ships only in multilock-cli: a namespace
portion may hold a ``__main__.py`` (``python -m`` runs it) but never an ``__init__.py``,
which would hide every other distribution's ``multilock.*`` package.
"""

import sys

from multilock.cli import main

sys.exit(main())
