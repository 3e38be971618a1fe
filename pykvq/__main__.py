import sys

from pykvq.commands.cli import main

sys.exit(main())
