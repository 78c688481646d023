"""`python -m h3cute build ...`: prebuild kernel bundles (h3cute.runtime.bundle);
`python -m h3cute ptx-digest ...`: PTX digests of every kernel variant (h3cute.runtime.ptx_digest).
`python -m h3cute COMMAND --help` describes each command's options."""
import sys

USAGE = ("usage: python -m h3cute build --arch sm_90a [--arch sm_100a] --out DIR [--kernel NAME ...] [--candidates]\n"
         "       python -m h3cute ptx-digest --arch sm_90a [--arch sm_100a] --out FILE [--against FILE] "
         "[--kernel NAME ...]")

if __name__ == "__main__":
    command = sys.argv[1:2]
    if command == ["build"]:
        from h3cute.runtime.bundle import main
    elif command == ["ptx-digest"]:
        from h3cute.runtime.ptx_digest import main
    elif command in (["-h"], ["--help"]):
        print(f"{USAGE}\n\n{__doc__}")
        sys.exit(0)
    else:
        print(USAGE, file=sys.stderr)
        sys.exit(2)
    sys.exit(main(sys.argv[2:]))
