"""`python -m shardprep.cli`: the `shardprep` command."""

import sys

from shardprep.cli import main

sys.exit(main())
