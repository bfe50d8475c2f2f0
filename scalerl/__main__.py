"""`python -m scalerl ...`: the same CLI as the `scalerl` script (torchrun launches modules with `-m`)."""

from scalerl.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
