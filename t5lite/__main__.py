"""`python -m t5lite ...`: the same as the `t5lite` command."""

from t5lite.cli.main import console_main

console_main()
