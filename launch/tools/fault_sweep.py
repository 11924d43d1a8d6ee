"""``python -m launch.tools.fault_sweep``: the command's name; the sweep is
``launch.tools.faults.fault_sweep``."""
from launch.tools.faults.fault_sweep import main

if __name__ == "__main__":
    main()
