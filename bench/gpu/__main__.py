"""`python -m bench.gpu`: the one-GPU measurement (measure.py)."""
import sys

from bench.gpu.measure import main

sys.exit(main())
