import sys

from benchmarks.page.build import main

sys.exit(main())
