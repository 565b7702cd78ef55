"""`python -m bench.cluster`: the emulated cluster's measurement (measure.py)."""
import sys

from bench.cluster.measure import main

sys.exit(main())
