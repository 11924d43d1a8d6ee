"""``python -m launch.scaling_law``: the command's name; the fit is ``launch.tools.scaling.scaling_law``."""
from launch.tools.scaling.scaling_law import main

if __name__ == "__main__":
    main()
