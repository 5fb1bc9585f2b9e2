"""``python -m reliable_mq.cli``: the ``reliable-mq`` command."""

import sys

from . import main

sys.exit(main())
