"""`python -m tonp_models.serve`: see tonp_models/serve/cli.py and docs/serving.md."""
from .cli import main

main()
