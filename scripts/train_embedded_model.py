#!/usr/bin/env python
"""Build the corpus for, train, package, install and evaluate snapquant's embedded model.

    python scripts/train_embedded_model.py build-data        # here, once: build/corpus + the tokenizer
    python scripts/train_embedded_model.py train --corpus build/corpus --device cuda \\
        --minutes 9 --out /tmp/embedded_run --export EXPORT_DIR   # on a CUDA GPU
    python scripts/train_embedded_model.py install --from EXPORT_DIR
    python scripts/train_embedded_model.py eval --limit 50    # optional: lm-eval scores into the card
    python scripts/train_embedded_model.py --help             # every option

The implementation, and the steps in full, are snapquant.training.embedded.
"""

from snapquant.training.embedded import main

if __name__ == "__main__":
    main()
