import sys

from cnr.app.cli import main

if __name__ == "__main__":
    sys.exit(main())
