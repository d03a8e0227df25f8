"""`python -m k3deploy ...` = the `k3deploy` command."""
import sys

from k3deploy.cli import main

sys.exit(main())
