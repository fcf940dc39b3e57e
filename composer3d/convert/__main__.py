import sys

from composer3d.convert.cli import main

sys.exit(main())
