import sys

from analysis.store.cli import main

sys.exit(main())
