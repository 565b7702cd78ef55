"""`python -m bench.cluster`: the emulated cluster's measurement (measure.py)."""
import sys

from bench.cluster.measure import main

if __name__ == "__main__":
    sys.exit(main())
