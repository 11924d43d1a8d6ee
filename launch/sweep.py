"""``python -m launch.sweep``: the command's name; the sweep is ``launch.tools.sweep``."""
from launch.tools.sweep import main

if __name__ == "__main__":
    main()
