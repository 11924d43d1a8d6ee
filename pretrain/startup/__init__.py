"""What is settled and checked before the first step: every flag and data file before any process group
exists (``validation``), then each rank's own files once the ranks can talk (``preflight``)."""
