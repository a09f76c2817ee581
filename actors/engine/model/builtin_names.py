"""The names of the built-in models (default_model.py builds them): what a config may name without
loading torch, so that processes that only read the config (the scheduler, the ingress) start fast."""

DEFAULT_MODEL = "builtin:tiny-llama"
SMOLLM2_MODEL = "builtin:smollm2"
