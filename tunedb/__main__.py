"""``python -m tunedb``: the same command line as the ``tunedb`` script."""

from tunedb.cli import main

if __name__ == "__main__":
    main()
