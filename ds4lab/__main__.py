import sys

from ds4lab.cli import main

sys.exit(main())
