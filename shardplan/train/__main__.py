"""``python -m shardplan.train`` (under torchrun): the training entry point."""

import sys

from shardplan.train.trainer import main

sys.exit(main())
