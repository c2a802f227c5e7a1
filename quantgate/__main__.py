import sys

from quantgate.cli import main

sys.exit(main())
