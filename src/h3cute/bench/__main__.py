"""`python -m h3cute.bench ...` is the `h3cute-bench` console script."""
from h3cute.bench.cli import main

raise SystemExit(main())
