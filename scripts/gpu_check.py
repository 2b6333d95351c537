"""Check on one CUDA device what the CPU test suite cannot (``make gpu-check``); see archon/gpu_check/.

python scripts/gpu_check.py --out outputs/gpu_check.json      # every check (CPU ones without CUDA)
python scripts/gpu_check.py --only varlen_attention,grouped_gemm
python scripts/gpu_check.py --list
"""

import sys

from archon.gpu_check.cli import main

if __name__ == "__main__":
    sys.exit(main())
