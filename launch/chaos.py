"""``python -m launch.chaos``: the command's name; the harness is ``launch.tools.chaos``."""
from launch.tools.chaos import main

if __name__ == "__main__":
    main()
