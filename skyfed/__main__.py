"""``python -m skyfed …``: the ``skyfed`` command (systemd units, the sim's daemons and the tests run it so)."""

import sys

from skyfed import main

sys.exit(main())
