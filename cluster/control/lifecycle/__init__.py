"""Starting the cluster (`launch.py`), resizing its pools while it serves (`scaling.py`, `draining.py`,
`role_flip.py`, `resize_state.py`), and the thread that runs periodic work beside it (`periodic.py`)."""
