import sys

from mmadapt.cli import main

sys.exit(main())
