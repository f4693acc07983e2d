import sys

from furlong.cli import main

sys.exit(main())
