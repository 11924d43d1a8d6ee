"""``python -m launch.plan``: the command's name; its command line is ``launch.tools.planning.plan_command``,
the planner ``launch.tools.planning.plan``."""
from launch.tools.planning.plan_command import main

if __name__ == "__main__":
    main()
