"""List every committed results folder with the command that produces it, and rerun them.

    python scripts/reproduce.py --list                       # folder, device, command of every job
    python scripts/reproduce.py --cpu                        # rerun the CPU jobs
    python scripts/reproduce.py --gpu                        # rerun the GPU jobs (CUDA)
    python scripts/reproduce.py --gpu --only results/bench   # the jobs of one folder
    python scripts/reproduce.py --cpu --dry-run              # print the commands only
    python scripts/reproduce.py --stale                      # results older than the code that writes them

The table of jobs and the runner are snapquant.reproduce (see snapquant/reproduce.py).
"""

import sys

from snapquant.reproduce import main

if __name__ == "__main__":
    sys.exit(main())
