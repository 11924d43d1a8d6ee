"""``python -m launch.chaos``: the command's name; the harness is ``launch.tools.faults.chaos``."""
from launch.tools.faults.chaos import main

if __name__ == "__main__":
    main()
