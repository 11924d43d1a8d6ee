"""``python -m launch.plan``: the command's name; the planner is ``launch.tools.plan``."""
from launch.tools.plan import main

if __name__ == "__main__":
    main()
