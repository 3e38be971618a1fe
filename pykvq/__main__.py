import sys

from pykvq.cli import main

sys.exit(main())
