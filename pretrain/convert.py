"""``python -m pretrain.convert``: the command's name; the converter is ``pretrain.interop.convert``."""
from pretrain.interop.convert import main

if __name__ == "__main__":
    main()
