"""`python -m h3cute build ...`: prebuild kernel bundles (see h3cute.runtime.bundle)."""
import sys

if __name__ == "__main__":
    if sys.argv[1:2] != ["build"]:
        sys.exit("usage: python -m h3cute build --arch sm_90a [--arch sm_100a] --out DIR [--kernel NAME ...]")
    from h3cute.runtime.bundle import main

    sys.exit(main(sys.argv[2:]))
