"""``python -m atlaslab.eval …``: lm-eval's command line with the ``atlaslab`` model class registered."""
import sys

from atlaslab.eval.lm_eval import main

if __name__ == "__main__":
    sys.exit(main())
