#!/usr/bin/env python3
"""The seed article's diagnosis script, a thin wrapper over `scalerl doctor` (same options):

    python scripts/diagnose.py --distributed-check
    python scripts/diagnose.py --performance-profiling [CONFIG.yaml] [key=value ...]
    torchrun --nproc-per-node 8 scripts/diagnose.py --distributed-check --json doctor.json
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from scalerl.cli import main

if __name__ == "__main__":
    sys.exit(main(["doctor", *sys.argv[1:]]))
