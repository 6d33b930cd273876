"""Training the models snapquant ships or studies: `embedded` builds the corpus for, trains, packages,
installs and evaluates the embedded model (the implementation of scripts/train_embedded_model.py)."""
