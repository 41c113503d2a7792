"""`python -m captioner.cli ...` (and `torchrun -m captioner.cli train ...`)."""
import sys

from captioner.cli import main

sys.exit(main())
