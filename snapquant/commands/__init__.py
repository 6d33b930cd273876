"""One module per CLI command; see snapquant/cli.py."""
