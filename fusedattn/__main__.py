"""`python -m fusedattn`: the same as the `fusedattn` command."""

import sys

from fusedattn.cli import main

sys.exit(main())
