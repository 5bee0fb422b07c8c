import sys

from kdtree_engine.cli import main

sys.exit(main())
