import sys

from vacancyd.cli import main

sys.exit(main())
