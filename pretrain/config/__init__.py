"""What a run is: the configuration dataclasses (one field per flag), the command line and YAML
parsed into them, and Megatron-LM's other flags. Nothing here touches a file but the YAML it is given."""
