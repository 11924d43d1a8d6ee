"""``python -m launch.sweep``: the command's name; the sweep is ``launch.tools.scaling.sweep``."""
from launch.tools.scaling.sweep import main

if __name__ == "__main__":
    main()
