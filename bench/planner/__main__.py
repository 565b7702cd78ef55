"""`python -m bench.planner`: the layout planner's command line (plan.py)."""
import sys

from bench.planner.plan import main

sys.exit(main())
