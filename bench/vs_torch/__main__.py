"""`python -m bench.vs_torch`: ours against torch's own (measure.py)."""
import sys

from bench.vs_torch.measure import main

sys.exit(main())
