"""`python -m bench.planner`: the layout planner's command line (plan.py)."""
import sys

from bench.planner.plan import main

if __name__ == "__main__":
    sys.exit(main())
